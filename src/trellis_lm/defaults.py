"""The defaults that several parts state: each value once, read by the configuration (its
fields' defaults), the ops (their keyword arguments' defaults) and the conversion (its options
and command line). A leaf: it imports nothing, so the ops and the configuration both read it.

A model's config holds the values it computes with; these are what a caller who names none gets.
"""

from __future__ import annotations

# Trellis and Lattice (design pages trellis.md, lattice.md): memory slots M per head and the
# chunk size C of the ops.
NUM_SLOTS = 64
CHUNK_SIZE = 16
# Trellis's compression and mixing functions, and where each write takes its inner gradient.
# A config.json saved before `write_gradient` existed means "anchored" (TrellisConfig.saved_before).
COMPRESS_FN = "layernorm"
# Softmax, not the paper's ln_silu, since the defaults study (docs/results_lm_defaults.md): at the
# same rate it was below ln_silu in every seed, level with the same-size Llama at its own swept rate
# (the recipes' 3e-3), flatter far past the training length. Every config.json names its mix_fn
# (it is no field of transformers' base config), so checkpoints saved before keep ln_silu.
MIX_FN = "softmax"
WRITE_GRADIENT = "exact"
# The memory mixers' short convolution on q and k: 2 taps (the token and the one before), not 4,
# since the defaults study (docs/results_lm_defaults.md): level with 4 taps at the training length
# over five seeds, flatter against the Llama far out on text of another domain. Every config.json
# names its conv_size, so checkpoints saved before keep 4.
CONV_SIZE = 2
# Lattice's write rule.
LATTICE_VARIANT = "dec"
# KVM (design page kvm.md): the chunk size (a chunk is folded into the state as a whole), the
# window in chunks, the sinks, the state rows and the budget rule with its parameters.
KVM_CHUNK_SIZE = 256
KVM_WINDOW_CHUNKS = 2
KVM_SINKS = 1
KVM_STATE_SIZE = 256
KVM_BUDGET = "fixed"
KVM_BUDGET_SCALE = 16.0
KVM_BUDGET_EXPONENT = 0.5
KVM_BUDGET_SATURATION = 1024.0
