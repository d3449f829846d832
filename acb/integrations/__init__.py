"""Integrations with the tools acb users already run: TRL (``acb.integrations.trl``), lm-evaluation-harness (``acb.integrations.lm_eval``)."""
