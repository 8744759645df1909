"""Convert a Llama-family model to Trellis and distil the teacher into it, with the Python API.

    python examples/convert_and_distill.py SRC DST --data corpus.txt   # a checkpoint already on disk
    python examples/convert_and_distill.py --smoke                      # nothing on disk: a tiny teacher first

``--smoke`` first trains a small Llama (about 1M parameters) for a few minutes on the docstrings
of the Python standard library, as ``examples/demo.py`` does, to stand in for a downloaded
checkpoint; everything is written to a temporary folder. After the conversion and after each
stage the script prints the layer-wise error (stage 1's measure: 1.0 means a mixer outputs
nothing of the teacher's attention), the KL divergence to the teacher on held-out text, and
both models' perplexity there.

The same pipeline as a command: ``trellis-lm convert SRC DST --distill --data ...``
(see docs/conversion.md).
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from demo import stdlib_docstrings
from trellis_lm import train_tokenizer
from trellis_lm.conversion import (
    TokenBlocks,
    convert_llama_to_trellis,
    distill_layerwise,
    distill_logits,
    distillation_arguments,
    layerwise_errors,
    logit_kl,
)
from trellis_lm.conversion.pipeline import read_texts


def train_tiny_llama(texts: list[str], folder: Path, steps: int, seq_len: int = 128) -> None:
    """Train a small Llama (grouped-query attention, tied head) on ``texts``; save it with its tokenizer."""
    tokenizer = train_tokenizer(texts, vocab_size=2048)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=384, tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    model = LlamaForCausalLM(config)
    blocks = TokenBlocks.from_texts(texts, tokenizer, seq_len).rows[:-1]  # equal lengths: drop the short tail
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=steps, pct_start=0.05)
    for step in range(steps):
        batch = torch.stack([blocks[i] for i in torch.randint(len(blocks), (16,))])
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        if step % 50 == 0 or step == steps - 1:
            print(f"  teacher step {step:4d}  loss {loss.item():.3f}")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


@torch.no_grad()
def report(stage: str, student, teacher, held_out: torch.Tensor) -> None:
    """One line: mean layer-wise error, KL to the teacher, perplexities, on ``held_out [B, T]``."""
    student.eval()
    errors = layerwise_errors(student, teacher, held_out)
    kl = logit_kl(student, teacher, held_out)
    ppl = [math.exp(m(input_ids=held_out, labels=held_out).loss.item()) for m in (student, teacher)]
    print(f"{stage:>12}: layer error {errors.mean():.3f} (max {errors.max():.3f})  KL {kl:.3f}  "
          f"perplexity {ppl[0]:.1f} (teacher {ppl[1]:.1f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", nargs="?", help="local Llama/Mistral/Qwen2/Qwen3 checkpoint folder")
    parser.add_argument("dst", nargs="?", help="output folder")
    parser.add_argument("--data", nargs="+", default=[], help=".txt / .jsonl files or folders (see trellis-lm convert)")
    parser.add_argument("--smoke", action="store_true", help="train a tiny Llama teacher first; no SRC needed")
    parser.add_argument("--teacher-steps", type=int, default=400, help="--smoke: teacher training steps")
    parser.add_argument("--num-slots", type=int, default=32)
    parser.add_argument("--chunk-size", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--stage1-steps", type=int, default=200)
    parser.add_argument("--stage2-steps", type=int, default=200)
    parser.add_argument("--lora-rank", type=int, default=16, help="0 trains full weights in stage 2")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="trellis-convert-"))
    if args.smoke:
        texts = stdlib_docstrings(max_chars=2_000_000)
        src, dst = work / "teacher", work / "trellis"
        print(f"training a tiny Llama teacher in {src}")
        train_tiny_llama(texts[:-200], src, args.teacher_steps)
    elif args.src and args.dst and args.data:
        texts, src, dst = read_texts(args.data), Path(args.src), Path(args.dst)
    else:
        parser.error("give SRC DST --data ..., or --smoke")
    # The last texts are held out for the measurements.
    train_texts, held_texts = texts[:-200], texts[-200:]

    student = convert_llama_to_trellis(src, dst, num_slots=args.num_slots, chunk_size=args.chunk_size).float()
    teacher = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(dst)
    data = TokenBlocks.from_texts(train_texts, tokenizer, args.block_size)
    held_out = torch.stack(TokenBlocks.from_texts(held_texts, tokenizer, args.block_size).rows[:16])
    report("converted", student, teacher, held_out)

    stage1 = distillation_arguments(str(work / "layerwise"), max_steps=args.stage1_steps, learning_rate=1e-2,
                                    save_steps=100, logging_steps=25)
    student = distill_layerwise(student, teacher, data, stage1, tokenizer=tokenizer)
    report("stage 1", student, teacher, held_out)

    lora_rank = args.lora_rank or None
    stage2 = distillation_arguments(str(work / "logits"), max_steps=args.stage2_steps, logging_steps=25,
                                    learning_rate=1e-3 if lora_rank else 3e-4, save_steps=100)
    student = distill_logits(student, teacher, data, stage2, tokenizer=tokenizer, lora_rank=lora_rank)
    report("stage 2", student, teacher, held_out)

    student.save_pretrained(dst)
    prompt = tokenizer(held_texts[0][:60], return_tensors="pt")
    sample = student.generate(**prompt, max_new_tokens=30, do_sample=False)
    print(f"saved to {dst}; checkpoints in {work}\nsample: {tokenizer.decode(sample[0], skip_special_tokens=True)!r}")


if __name__ == "__main__":
    main()
