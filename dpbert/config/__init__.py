"""Run configuration: the recipe schema and loader (`recipe`), the pure plan builders (recipe ->
privacy plan and ledger: `plan` for pretraining, `finetune` for fine-tuning) and the fine-tuning
defaults planner (`finetune_defaults`), shared by training, `dpbert verify` and `dpbert privacy`.
Depends on `dpbert.privacy`, `dpbert.atomic` and `dpbert.model.lora` (a fine-tuning recipe's
LoRA section) only: nothing here imports `train` or `release`."""
