"""MinT's own engine: a base model adapted in place, batched LoRA rows, a continuous-batching
scheduler and sampling."""
