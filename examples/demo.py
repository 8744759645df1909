"""Train a small Trellis model from nothing downloaded, save it Hub-ready, generate, and
compare its fixed-size cache with a same-size Llama's KV cache.

    make demo                                   # or: .venv/bin/python examples/demo.py
    .venv/bin/python examples/demo.py --steps 20 --out /tmp/demo   # a quick smoke run

The training text is the docstrings of the Python standard library on this machine, read
with ``ast`` (no module is imported), so the demo needs no network and no data files.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

import trellis_lm
from trellis_lm import TrellisConfig, TrellisForCausalLM, train_tokenizer
from trellis_lm.cache_trellis import CACHE_ARG
from trellis_lm.model_card_trellis import TrainingRun, write_model_card
from trellis_lm.state_passing import DEFAULT_PROBABILITY, DEFAULT_START_FRACTION, StatePassing
from trellis_lm.training import stdlib_docstrings


def token_batches(ids: torch.Tensor, seq_len: int, batch_size: int, steps: int, seed: int):
    """Random windows of the token stream, ``[batch_size, seq_len]`` each."""
    rng = random.Random(seed)
    for _ in range(steps):
        starts = [rng.randrange(0, ids.numel() - seq_len) for _ in range(batch_size)]
        yield torch.stack([ids[s : s + seq_len] for s in starts])


def llama_kv_bytes(config: TrellisConfig, tokens: int, bytes_per_value: int) -> int:
    """KV cache of a Llama with the same layers, heads and head size (full multi-head attention)."""
    return 2 * config.num_hidden_layers * config.num_heads * config.head_dim * tokens * bytes_per_value


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024:
            return f"{n:7.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"


@torch.no_grad()
def measured_cache_bytes(model, tokens: int, piece: int = 4096) -> int:
    """Run ``tokens`` random tokens through the model in pieces and return the cache's size."""
    cache = None
    for start in range(0, tokens, piece):
        ids = torch.randint(0, model.config.vocab_size, (1, min(piece, tokens - start)))
        cache = getattr(model(input_ids=ids, use_cache=True, **{CACHE_ARG: cache}), CACHE_ARG)
    assert cache.get_seq_length() == tokens
    return cache.nbytes()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="outputs/demo-model", help="where the Hub-ready folder is written")
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)

    texts = stdlib_docstrings(max_chars=1_000_000)  # about 1.3 passes over it in the default steps
    tokenizer = train_tokenizer(texts, vocab_size=2048)
    ids = torch.tensor(tokenizer("\n\n".join(texts))["input_ids"])
    print(f"corpus: {len(texts)} standard-library docstrings, {ids.numel():,} tokens, vocabulary {len(tokenizer)}")

    config = TrellisConfig(
        vocab_size=len(tokenizer), hidden_size=128, num_hidden_layers=4, num_heads=4, head_dim=32, num_slots=16,
        chunk_size=16, intermediate_size=384, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    model = TrellisForCausalLM(config)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, {config.num_hidden_layers} "
          f"layers, {config.num_heads} heads x {config.num_slots} memory slots, chunk size {config.chunk_size}")

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    schedule = get_cosine_schedule_with_warmup(optimizer, max(1, args.steps // 10), args.steps)
    model.train()
    progress = tqdm(token_batches(ids, args.seq_len, args.batch_size, args.steps, args.seed), total=args.steps,
                    desc="training")
    # State passing over the last 30% of the steps, as the recipes do: rows then start from the
    # memories of earlier batches, so the model reads far past --seq-len (trellis_lm.state_passing).
    passing, first_passed = StatePassing(DEFAULT_PROBABILITY, seed=args.seed), int(DEFAULT_START_FRACTION * args.steps)
    with contextlib.ExitStack() as attached:
        for step, batch in enumerate(progress):
            if step == first_passed:
                attached.enter_context(passing.attached(model))
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            progress.set_postfix(loss=f"{loss.item():.3f}")

    out = Path(args.out)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    run = TrainingRun(
        recipe="examples/demo.py", steps=args.steps, final_loss=loss.item(),
        data=f"{len(texts)} docstrings of this Python's standard library ({ids.numel():,} tokens)",
        settings={"batch": f"{args.batch_size} random windows of {args.seq_len} tokens", "learning rate": "3e-3 (cosine)",
                  "state passing": f"p = {DEFAULT_PROBABILITY:g} from {DEFAULT_START_FRACTION:g} of the steps"},
    )
    write_model_card(out, model, training=run)
    print(f"saved a Hub-ready folder (weights, config, code, tokenizer, model card) to {out}: "
          + ", ".join(sorted(p.name for p in out.iterdir())))

    model = AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    prompts = ["Return the number of", "This module provides"]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    start = time.perf_counter()
    generated = model.generate(**batch, max_new_tokens=40, do_sample=True, top_p=0.9, temperature=0.8)
    seconds = time.perf_counter() - start
    for text in tokenizer.batch_decode(generated, skip_special_tokens=True):
        print(f"  > {text!r}")
    print(f"generate(): 2 prompts x 40 new tokens in {seconds:.1f} s")

    print("\ncache size for one sequence (float32), Trellis measured, Llama of the same size by formula:")
    print(f"  {'tokens':>9} | {'Trellis':>12} | {'Llama KV':>12}")
    for tokens in (1_024, 32_768, 1_048_576):
        measured = measured_cache_bytes(model, tokens) if tokens <= 32_768 else None
        trellis = human(measured) if measured is not None else "same (fixed)"
        print(f"  {tokens:>9,} | {trellis:>12} | {human(llama_kv_bytes(config, tokens, 4)):>12}")
    print(f"(trellis_lm {trellis_lm.__version__}; the Trellis cache holds each layer's memories, their anchors and"
          " the short-conv tails: its size does not depend on the number of tokens seen)")


if __name__ == "__main__":
    main()
