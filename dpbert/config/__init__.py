"""Run configuration: the recipe schema and loader, and the pure plan builders (recipe -> privacy
plan and ledger) that training, `dpbert verify` and `dpbert privacy` share. Depends on
`dpbert.privacy` and `dpbert.data` only."""
