"""Launch the dpbert fill-mask demo: `python demo/app.py MODEL [MODEL ...] [--port P] [--share]`.

The same as `dpbert demo`; the app itself is `dpbert.demo.app` so the installed command has it.
"""

import sys

from dpbert.cli import main

if __name__ == "__main__":
    sys.exit(main(["demo", *sys.argv[1:]]))
