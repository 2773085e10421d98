"""What tests build on: tiny checkpoints with a local tokenizer, and real engines next to HF."""
