"""One nn.Module concept per file: norm, rotary embedding, attention, MLP, sampler."""
