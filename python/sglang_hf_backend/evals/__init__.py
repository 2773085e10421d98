"""Evaluation helpers behind scripts/rouge_parity.py and scripts/mmlu.py."""
