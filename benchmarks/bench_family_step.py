"""A whole-process workload over every mixer kind, for A/B timing of two checkouts (each run a
fresh process, the two checkouts alternated, the ratio taken pair by pair): 12 training steps
(forward, backward, AdamW) of a 4-layer hybrid (Trellis, Lattice, attention, KVM; width 128) on
8 x 256 tokens, then greedy generation of 48 tokens for 2 rows.

    for i in 1 2 3 4 5 6; do
        /usr/bin/time -f "old %e s" env PYTHONPATH=<old>/src .venv/bin/python benchmarks/bench_family_step.py
        /usr/bin/time -f "new %e s" env PYTHONPATH=src .venv/bin/python benchmarks/bench_family_step.py
    done
"""

import torch
from trellis_lm import TrellisConfig, TrellisForCausalLM
torch.set_num_threads(2)
torch.manual_seed(0)
config = TrellisConfig(vocab_size=2048, hidden_size=128, num_hidden_layers=4, num_heads=4, head_dim=32, num_slots=32,
                       intermediate_size=344, mixer_types=["trellis", "lattice", "attention", "kvm"], kvm_chunk_size=32, kvm_state_size=64)
model = TrellisForCausalLM(config)
opt = torch.optim.AdamW(model.parameters(), 1e-3)
ids = torch.randint(0, 2048, (8, 256))
for _ in range(12):
    loss = model(ids, labels=ids).loss
    loss.backward(); opt.step(); opt.zero_grad()
model.eval()
out = model.generate(ids[:2, :64], max_new_tokens=48, do_sample=False)
print(out.shape)
