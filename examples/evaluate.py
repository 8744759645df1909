"""Evaluate a Trellis checkpoint with lm-evaluation-harness (offline demo tasks by default).

    .venv/bin/python examples/pretrain.py                      # makes outputs/pretrain first
    .venv/bin/python examples/evaluate.py outputs/pretrain     # trellis_demo: loglikelihood + generate_until
    .venv/bin/python examples/evaluate.py outputs/pretrain --tasks hellaswag --limit 100

The same with lm-eval's own command line (stock "hf" model, the checkpoint's code):

    lm_eval --model hf --model_args pretrained=outputs/pretrain,trust_remote_code=True \\
        --tasks trellis_demo --include_path "$(python -c 'import trellis_lm.eval as e; print(e.TASKS_DIR)')"

Loglikelihood requests run in right-padded batches, generate_until requests in left-padded
batches through generate() and the fixed-size cache. lm-eval truncates contexts to the
tokenizer's model_max_length (Trellis itself has no limit); pass --max-length to change it.
"""

import argparse

from lm_eval.utils import make_table

from trellis_lm.eval.harness import evaluate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default="outputs/pretrain", help="checkpoint folder or Hub id")
    parser.add_argument("--tasks", nargs="+", default=["trellis_demo"], help="lm-eval tasks or groups")
    parser.add_argument("--model-type", choices=("trellis", "hf"), default="trellis", help="lm-eval model name")
    parser.add_argument("--limit", type=float, default=None, help="documents per task")
    parser.add_argument("--max-length", type=int, default=None, help="context length lm-eval truncates to")
    args = parser.parse_args()
    model_args = {"max_length": args.max_length} if args.max_length else {}
    results = evaluate(args.model, args.tasks, model=args.model_type, model_args=model_args, limit=args.limit)
    print(make_table(results))


if __name__ == "__main__":
    main()
