"""Flax NNX BERT with Hugging Face interop (``bert``, ``hf_io``) and its pure view (``functional``)."""

from dpbert.model.bert import (
    BaseModelOutput,
    BertForMaskedLM,
    BertForSequenceClassification,
    BertModel,
    MaskedLMOutput,
    SequenceClassifierOutput,
)
from dpbert.model.functional import classifier_logits, hidden_states, merge, mlm_logits, split_params
from dpbert.model.hf_io import load_config

__all__ = [
    "BaseModelOutput",
    "BertForMaskedLM",
    "BertForSequenceClassification",
    "BertModel",
    "MaskedLMOutput",
    "SequenceClassifierOutput",
    "classifier_logits",
    "hidden_states",
    "load_config",
    "merge",
    "mlm_logits",
    "split_params",
]
