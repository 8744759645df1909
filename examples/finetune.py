"""Fine-tune a Trellis model on chats with the stock transformers Trainer (optionally LoRA).

    .venv/bin/python examples/finetune.py                                    # ~1 minute on a CPU, sample chats
    .venv/bin/python examples/finetune.py --model outputs/pretrain --data_files chats.jsonl --lora
    .venv/bin/python examples/finetune.py --lora --lora_target_modules q_proj v_proj o_proj

Each line of the JSONL files is ``{"messages": [{"role": "user", "content": ...}, ...]}``.
Chats are rendered with the tokenizer's chat template (a simple one is set when the
tokenizer has none) and the loss covers the assistant turns only: every prompt token's
label is -100. With ``--lora``, PEFT adapters train on the projections of
``trellis_lm.training.LORA_TARGET_MODULES``; OUTPUT_DIR then holds the adapter and
OUTPUT_DIR/merged the merged model. Without ``--model``, a new small model and tokenizer are
made from the data; without ``--data_files``, synthetic arithmetic chats are written to
OUTPUT_DIR/sample_chats.jsonl. The recipe is ``trellis_lm.training.finetune``;
``trellis-lm train finetune`` runs the same.
"""

from trellis_lm.training import FINETUNE_DEFAULTS, FinetuneArguments, chat_reply, finetune, parse_recipe_arguments


def main() -> None:
    args, training_args = parse_recipe_arguments(FinetuneArguments, FINETUNE_DEFAULTS)
    trainer = finetune(args, training_args)
    if trainer.is_world_process_zero():
        question = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "What is 12 + 30?"}]
        reply = chat_reply(trainer.model.eval(), trainer.processing_class, question)
        print(f"saved to {training_args.output_dir}; asked {question[-1]['content']!r}, the model replies {reply!r}")


if __name__ == "__main__":
    main()
