"""The model side of MinT: the user's base model and data, and training on them.

- `base`: the base is a Hugging Face causal LM folder (`MINT_BASE_MODEL`, or the embedded
  default that `tiny` builds), loaded with `AutoModelForCausalLM`; its identity is its id plus a
  digest over its weight files.
- `text`: its tokenizer, chat template, end-of-sequence ids and incremental detokenization.
- `datasets`: the user's JSONL rows (prompt/completion or chat messages), validated whole and
  tokenized with a loss mask; `toy` writes the embedded default's generated datasets.
- `training`: a PEFT LoRA trained on those rows (the `train` step), `imports` checks one made
  elsewhere; `generate` is greedy decoding for evaluation.
- `routing` records and replays which experts an MoE base routed each token to (R3), and `rl`
  is the policy-gradient loss with IcePop's per-token mask: RL on sampled completions.
"""
