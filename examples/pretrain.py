"""Pretrain a Trellis model with the stock transformers Trainer on packed documents.

    .venv/bin/python examples/pretrain.py                          # ~1 minute on a CPU, sample data
    .venv/bin/python examples/pretrain.py --data_files a.txt b.txt --max_steps 2000 \\
        --config_overrides "hidden_size=512,num_hidden_layers=8" --output_dir outputs/my-model
    .venv/bin/python examples/pretrain.py --resume_from_checkpoint last      # continue after a stop

Paragraphs of the text files are streamed with ``datasets`` (``load_dataset("text",
..., streaming=True)``), tokenized into pieces of at most ``--max_length`` tokens, and packed
``--per_device_train_batch_size`` at a time into one row by ``DataCollatorWithFlattening``;
the model restarts its memories at every piece. Every ``TrainingArguments`` option works
(``--bf16``, ``--gradient_checkpointing``, ``--gradient_accumulation_steps``, ...), and the
same script runs on several GPUs or CPU processes under ``torchrun`` / ``accelerate launch``.
Without ``--data_files`` it writes standard-library docstrings to OUTPUT_DIR/sample_corpus.txt.
The recipe is ``trellis_lm.training.pretrain``; ``trellis-lm train pretrain`` runs the same.
"""

from transformers import AutoModelForCausalLM, AutoTokenizer

from trellis_lm.training import PRETRAIN_DEFAULTS, PretrainArguments, parse_recipe_arguments, pretrain


def main() -> None:
    args, training_args = parse_recipe_arguments(PretrainArguments, PRETRAIN_DEFAULTS)
    trainer = pretrain(args, training_args)
    if trainer.is_world_process_zero():
        # The output folder is a complete checkpoint: load it back as anyone would and generate.
        model = AutoModelForCausalLM.from_pretrained(training_args.output_dir)
        tokenizer = AutoTokenizer.from_pretrained(training_args.output_dir)
        prompt = tokenizer(["Return the number of"], return_tensors="pt")
        output = model.generate(**prompt, max_new_tokens=30, do_sample=False)
        print(f"saved to {training_args.output_dir}; sample: {tokenizer.decode(output[0], skip_special_tokens=True)!r}")


if __name__ == "__main__":
    main()
