"""Prompt-lookup decoding and reused prompt states on CPU, Trellis against a same-size Llama.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_speculative.py           # about 4 minutes
    PYTHONPATH=src .venv/bin/python benchmarks/bench_speculative.py --quick   # a smoke run

1. **An input-grounded task**: each example is L random tokens, a separator, and the same L
   tokens again. A Trellis model (the cpu MQAR size: hidden 64, 2 layers, 2 heads of 32, 32
   slots, chunks of 16) and a Llama of the same width and depth are trained from scratch to copy
   (the loss on the copy only), then decode the copy from the prompt "tokens, separator" greedily,
   plainly and with ``prompt_lookup_num_tokens``: tokens/s of each (the same tokens are asserted),
   the drafts' acceptance (tokens per verification call), and the bytes the Trellis cache keeps
   to roll back at the end.
2. **A reused prompt state**: time to the first token of a 16-token question after a 4096-token
   document, read afresh against a copy (``cache.copy()``) of the document's cache.

One torch thread; medians over the prompts (and rounds); comparisons are ratios measured in the
same run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from trellis_lm import TrellisConfig, TrellisForCausalLM

VOCAB, SEP = 64, 1


def models(seed: int) -> dict[str, torch.nn.Module]:
    torch.manual_seed(seed)
    trellis = TrellisForCausalLM(TrellisConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_heads=2, head_dim=32, num_slots=32, chunk_size=16,
        intermediate_size=128, pad_token_id=None, bos_token_id=None, eos_token_id=None,
    ))
    llama = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        head_dim=32, intermediate_size=128, max_position_embeddings=4096 + 64, pad_token_id=None, bos_token_id=None,
        eos_token_id=None, tie_word_embeddings=False,
    ))
    return {"trellis": trellis, "llama": llama}


def copy_batch(batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """``[batch, 2 L + 1]``: L tokens, the separator, the same L tokens."""
    tokens = torch.randint(2, VOCAB, (batch, length), generator=generator)
    return torch.cat([tokens, torch.full((batch, 1), SEP), tokens], dim=1)


def train(model: torch.nn.Module, length: int, steps: int, seed: int) -> float:
    """AdamW on the copy loss; returns the final copy accuracy on a held-out batch."""
    gen = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 30))
    model.train()
    for _ in range(steps):
        ids = copy_batch(32, length, gen)
        logits = model(input_ids=ids[:, :-1]).logits[:, length:]  # predicting the copy
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, length + 1 :].reshape(-1))
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
    model.eval()
    ids = copy_batch(64, length, torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        predicted = model(input_ids=ids[:, :-1]).logits[:, length:].argmax(-1)
    return (predicted == ids[:, length + 1 :]).float().mean().item()


def timed_generate(model: torch.nn.Module, prompt: torch.Tensor, new: int, **options) -> tuple[float, torch.Tensor, int]:
    """Seconds, the tokens, and the number of forward calls of one greedy ``generate``."""
    calls = [0]
    handle = model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    start = time.perf_counter()
    out = model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                         return_dict_in_generate=True, **options)
    seconds = time.perf_counter() - start
    handle.remove()
    return seconds, out, calls[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, few prompts")
    parser.add_argument("--length", type=int, default=None, help="tokens to copy (default 24; 16 with --quick)")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default 1500; 40 with --quick)")
    parser.add_argument("--prompts", type=int, default=None, help="prompts timed (default 8; 2 with --quick)")
    parser.add_argument("--lookup", type=int, default=10, help="prompt_lookup_num_tokens")
    parser.add_argument("--document", type=int, default=None, help="document tokens (default 4096; 256 with --quick)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    length = args.length or (16 if args.quick else 24)
    steps = args.steps or (40 if args.quick else 1500)
    prompts = args.prompts or (2 if args.quick else 8)
    document = args.document or (256 if args.quick else 4096)

    nets = models(seed=0)
    for name, model in nets.items():
        start = time.perf_counter()
        accuracy = train(model, length, steps, seed=1)
        print(f"trained {name}: copy accuracy {accuracy:.3f} ({time.perf_counter() - start:.0f} s, {steps} steps)")

    print(f"\n(1) copying {length} tokens after 'tokens, separator'; greedy, batch 1, 1 thread, {prompts} prompts")
    gen = torch.Generator().manual_seed(2)
    rates: dict[str, float] = {}
    with torch.no_grad():
        for name, model in nets.items():
            model.generate(copy_batch(1, length, gen)[:, : length + 1], max_new_tokens=4)  # warm-up
            plain_s, lookup_s, verifications, kept = [], [], [], []
            for _ in range(prompts):
                prompt = copy_batch(1, length, gen)[:, : length + 1]
                t_plain, plain, _ = timed_generate(model, prompt, length)
                t_lookup, lookup, calls = timed_generate(model, prompt, length, prompt_lookup_num_tokens=args.lookup)
                assert torch.equal(plain.sequences, lookup.sequences), f"{name}: prompt lookup changed the tokens"
                plain_s.append(t_plain)
                lookup_s.append(t_lookup)
                verifications.append(length / max(calls - 1, 1))  # after the prefill call
                if name == "trellis":
                    kept.append((lookup.cache if hasattr(lookup, "cache") else lookup.past_key_values).rollback_nbytes())
            plain_tps, lookup_tps = length / statistics.median(plain_s), length / statistics.median(lookup_s)
            rates[name] = lookup_tps / plain_tps
            print(f"  {name:8s} plain {plain_tps:7.1f} tokens/s   prompt lookup {lookup_tps:7.1f} tokens/s   "
                  f"= {rates[name]:.2f}x   tokens per verification call {statistics.median(verifications):.2f}")
            if kept:
                print(f"  {'':8s} the Trellis cache keeps {statistics.median(kept) / 1024:.1f} KiB to roll back")

    print(f"\n(2) first token of a 16-token question after a {document}-token document (Trellis)")
    trellis = nets["trellis"]
    doc = torch.randint(2, VOCAB, (1, document), generator=gen)
    question = torch.randint(2, VOCAB, (1, 16), generator=gen)
    with torch.no_grad():
        read_once = trellis(doc, use_cache=True)
        read_once = read_once.cache if hasattr(read_once, "cache") else read_once.past_key_values
        fresh, reused = [], []
        for _ in range(3 if args.quick else 5):
            start = time.perf_counter()
            trellis(torch.cat([doc, question], dim=1), use_cache=True).logits[:, -1].argmax(-1)
            fresh.append(time.perf_counter() - start)
            start = time.perf_counter()
            trellis(question, cache=read_once.copy()).logits[:, -1].argmax(-1)
            reused.append(time.perf_counter() - start)
    f, r = statistics.median(fresh), statistics.median(reused)
    print(f"  read afresh {f * 1e3:.1f} ms   from a copied cache {r * 1e3:.2f} ms   = {f / r:.0f}x sooner")


if __name__ == "__main__":
    main()
