"""dpbert: differentially private BERT pretraining in JAX (Anil et al., 2021)."""

__version__ = "0.1.0"
