"""The `dpbert` command lists only working subcommands and reports errors plainly."""

import subprocess
import sys

import dpbert
from dpbert import cli


def test_version_and_help_run_as_installed_script():
    out = subprocess.run([sys.executable, "-m", "dpbert.cli", "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"dpbert {dpbert.__version__}"


def test_every_listed_subcommand_has_help():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, subparser in sub.choices.items():
        assert subparser.format_help().startswith("usage: dpbert " + name)


def test_no_subcommand_prints_help_and_fails(capsys):
    assert cli.main([]) == 2
    assert "usage: dpbert" in capsys.readouterr().out
