"""The model: forward, padding, loss, init, checkpoints, training features."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModel, AutoModelForCausalLM

from tiny_models import SCHEDULES, VOCAB, left_pad, random_tokens, right_pad, tiny_config, tiny_model
from transformers_names import cache_of, enable_checkpointing, is_checkpointing
from trellis_lm import TrellisForCausalLM, TrellisModel
from trellis_lm.mixers import forget_gate_bias
from trellis_lm.mixers.valid_tokens import ValidTokens, document_starts

TOL = dict(rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- forward


def test_forward_outputs():
    model = tiny_model()
    ids = random_tokens(2, 7)
    out = model(ids, output_hidden_states=True)
    assert out.logits.shape == (2, 7, VOCAB)
    assert len(out.hidden_states) == model.config.num_hidden_layers + 1
    assert torch.equal(out.hidden_states[-1], model.model(ids).last_hidden_state)
    assert cache_of(out).get_seq_length() == 7
    logits, cache = model(ids, return_dict=False)
    torch.testing.assert_close(logits, out.logits)
    assert cache_of(model(ids, use_cache=False)) is None


def test_inputs_embeds_equal_input_ids():
    model = tiny_model()
    ids = random_tokens(2, 6)
    embeds = model.get_input_embeddings()(ids)
    torch.testing.assert_close(model(inputs_embeds=embeds).logits, model(ids).logits)
    with pytest.raises(ValueError, match="exactly one of input_ids or inputs_embeds"):
        model(ids, inputs_embeds=embeds)


def test_llama_module_names():
    names = set(tiny_model().state_dict())
    for name in (
        "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
        "model.layers.1.input_layernorm.weight", "model.layers.1.post_attention_layernorm.weight",
        "model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight", "model.layers.1.mlp.down_proj.weight",
        "model.layers.1.self_attn.q_conv.weight", "model.layers.1.self_attn.k_conv.weight",
        "model.layers.1.self_attn.o_norm.weight", "model.layers.1.self_attn.mk0", "model.layers.1.self_attn.mv0",
        "model.layers.1.self_attn.beta_proj.bias", "model.layers.1.self_attn.gamma_proj.bias",
    ) + tuple(f"model.layers.0.self_attn.{p}_proj.weight" for p in ("q", "k", "v", "alpha", "beta", "gamma", "g", "o")):
        assert name in names, name
    assert tiny_model().model.layers[0].self_attn.mk0.shape == (2, 6, 8)  # [H, M, d]


def test_optional_parts_are_absent_when_disabled():
    names = set(tiny_model(conv_size=0, use_forget_gate=False).state_dict())
    assert not any("conv" in n or "beta_proj" in n for n in names)


@pytest.mark.parametrize(
    "field, value",
    [("compress_fn", "l2norm"), ("mix_fn", "ln_silu"), ("conv_size", 2), ("conv_size", 0), ("use_forget_gate", False),
     ("gate_logit_normalizer", 2.0), ("rms_norm_eps", 0.5), ("initializer_range", 0.1),
     ("write_gradient", "anchored")],
)
def test_every_behavioural_field_changes_the_model(field, value):
    ids = random_tokens(1, 9)
    assert not torch.allclose(tiny_model(**{field: value})(ids).logits, tiny_model()(ids).logits)


def test_the_chunk_size_is_part_of_anchored_models_only():
    """Anchored writes take stale gradients inside a chunk: C changes the function. Exact writes
    compute one function whatever C, in the same layout: the same logits to the bit."""
    ids = random_tokens(1, 9)
    anchored = [tiny_model(write_gradient="anchored", chunk_size=c)(ids).logits for c in (3, 4)]
    assert not torch.allclose(*anchored)
    assert torch.equal(tiny_model(chunk_size=3)(ids).logits, tiny_model(chunk_size=4)(ids).logits)


# ----------------------------------------------------------------------------- padding


def test_left_and_right_padding_give_each_row_what_it_gets_alone():
    model = tiny_model(seed=1)
    rows = [random_tokens(1, n, seed=n)[0] for n in (9, 4, 1, 6)]
    alone = [model(r[None]).logits[0] for r in rows]
    for pad in (left_pad, right_pad):
        ids, mask = pad(rows)
        logits = model(ids, attention_mask=mask).logits
        for i, expected in enumerate(alone):
            torch.testing.assert_close(logits[i][mask[i].bool()], expected, **TOL)


def test_padding_anywhere_is_skipped():
    model = tiny_model(seed=2, chunk_size=3)
    ids = random_tokens(2, 10)
    mask = torch.ones_like(ids)
    mask[0, [1, 2, 5, 9]] = 0
    mask[1, [0, 4]] = 0
    logits = model(ids, attention_mask=mask).logits
    for i in range(2):
        keep = mask[i].bool()
        torch.testing.assert_close(logits[i][keep], model(ids[i][keep][None]).logits[0], **TOL)


def test_mask_forms():
    model = tiny_model()
    ids, mask = left_pad([random_tokens(1, 5)[0], random_tokens(1, 3, seed=1)[0]])
    expected = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(model(ids, attention_mask={"linear_attention": mask}).logits, expected)
    torch.testing.assert_close(model(ids, attention_mask=mask.bool()).logits, expected)
    # A mask covers the cache's past tokens and the input, no more and no fewer.
    longer = torch.cat([torch.ones(2, 4, dtype=torch.long), mask], dim=1)
    with pytest.raises(ValueError, match=r"attention_mask must be a 2-D padding mask \[B = 2, past \+ T = 0 \+ 5\]"):
        model(ids, attention_mask=longer)
    torch.testing.assert_close(model(ids, attention_mask={"linear_attention": None}).logits, model(ids).logits)
    with pytest.raises(ValueError, match="2-D padding mask"):
        model(ids, attention_mask=mask[:, :2])


def test_padding_information_travels_between_devices():
    # accelerate moves a block's inputs to its device through `.to`; ValidTokens must follow.
    from accelerate.utils import send_to_device

    ids, mask = left_pad([random_tokens(1, 5)[0], random_tokens(1, 3, seed=1)[0]])
    valid = ValidTokens.from_attention_mask(mask, 2, 5)
    moved = send_to_device(valid, torch.device("cpu"))
    assert isinstance(moved, ValidTokens)
    for name in ("mask", "lengths", "cu_seqlens", "order", "seq_rows", "continues_row", "last_seqs"):
        assert torch.equal(getattr(moved, name), getattr(valid, name))
    assert moved.reach is None
    assert valid.cu_seqlens.tolist() == [0, 5, 8]


# ----------------------------------------------------------------------------- packed documents


def _documents(lengths: tuple[int, ...]) -> list[torch.Tensor]:
    return [random_tokens(1, n, seed=10 + i)[0] for i, n in enumerate(lengths)]


def test_packed_documents_give_each_document_what_it_gets_alone():
    from transformers import DataCollatorWithFlattening

    model = tiny_model(seed=5, chunk_size=3)
    docs = _documents((5, 1, 7, 2, 4))  # across chunk boundaries, shorter and longer than the conv
    batch = DataCollatorWithFlattening()([{"input_ids": d.tolist()} for d in docs])
    assert batch["input_ids"].shape == (1, 19)
    logits = model(**batch).logits[0]
    for doc, piece in zip(docs, logits.split([len(d) for d in docs])):
        torch.testing.assert_close(piece, model(doc[None]).logits[0], **TOL)


def test_packed_loss_and_gradients_are_those_of_the_documents():
    from transformers import DataCollatorWithFlattening

    model = tiny_model(seed=6, chunk_size=3).train()
    docs = _documents((6, 3, 5))

    def summed_loss_gradients(**batch):
        model.zero_grad()
        loss = model(**batch, num_items_in_batch=1).loss
        loss.backward()
        return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}

    loss, packed = summed_loss_gradients(**DataCollatorWithFlattening()([{"input_ids": d.tolist()} for d in docs]))
    alone = [summed_loss_gradients(input_ids=d[None], labels=d[None]) for d in docs]
    torch.testing.assert_close(loss, sum(a[0] for a in alone), **TOL)
    for name, grad in packed.items():
        torch.testing.assert_close(grad, sum(a[1][name] for a in alone), rtol=1e-4, atol=1e-5, msg=name)


def test_packed_rows_with_padding_and_a_cache():
    model = tiny_model(seed=7, chunk_size=3)
    first, second = _documents((4, 6)), _documents((5, 2))  # a last document shorter than the conv tail
    rows = [torch.cat(first), torch.cat(second)]
    ids, mask = left_pad(rows)
    positions = torch.zeros_like(ids)
    for i, docs in enumerate((first, second)):
        positions[i, mask[i].bool()] = torch.cat([torch.arange(len(d)) for d in docs])
    out = model(ids, attention_mask=mask, position_ids=positions, use_cache=True)
    for i, docs in enumerate((first, second)):
        pieces = out.logits[i][mask[i].bool()].split([len(d) for d in docs])
        for doc, piece in zip(docs, pieces):
            torch.testing.assert_close(piece, model(doc[None]).logits[0], **TOL)
    # The cache continues each row's last document.
    nxt = random_tokens(2, 2, seed=99)
    cont = model(nxt, attention_mask=torch.cat([mask, torch.ones_like(nxt)], 1), past_key_values=cache_of(out))
    for i, docs in enumerate((first, second)):
        alone = model(torch.cat([docs[-1], nxt[i]])[None]).logits[0, -2:]
        torch.testing.assert_close(cont.logits[i], alone, **TOL)


def test_position_ids_without_restarts_change_nothing():
    # generate()-style positions (counted from each row's first real token) hold no document start.
    model = tiny_model()
    ids, mask = left_pad([random_tokens(1, 7)[0], random_tokens(1, 4, seed=1)[0]])
    positions = (mask.cumsum(1) - 1).masked_fill(mask == 0, 1)
    assert ValidTokens.from_attention_mask(mask, 2, 7, starts=document_starts(2, 7, positions)).has_documents is False
    torch.testing.assert_close(model(ids, attention_mask=mask, position_ids=positions).logits,
                               model(ids, attention_mask=mask).logits, rtol=0, atol=0)
    with pytest.raises(ValueError, match="position_ids must be 2-D"):
        model(ids, position_ids=positions[0])


# ----------------------------------------------------------------------------- loss


def test_loss_is_the_shifted_cross_entropy():
    model = tiny_model()
    ids = random_tokens(2, 8)
    labels = ids.clone()
    labels[0, :3] = -100
    out = model(ids, labels=labels)
    expected = F.cross_entropy(out.logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100)
    torch.testing.assert_close(out.loss, expected)


def test_num_items_in_batch_divides_the_summed_loss():
    model = tiny_model()
    ids = random_tokens(2, 8)
    out = model(ids, labels=ids, num_items_in_batch=torch.tensor(40))
    summed = F.cross_entropy(out.logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1), reduction="sum")
    torch.testing.assert_close(out.loss, summed / 40)


def test_logits_to_keep():
    model = tiny_model()
    ids = random_tokens(2, 8)
    full = model(ids).logits
    torch.testing.assert_close(model(ids, logits_to_keep=1).logits, full[:, -1:])
    torch.testing.assert_close(model(ids, logits_to_keep=torch.tensor([0, 5])).logits, full[:, [0, 5]])
    torch.testing.assert_close(model(ids, logits_to_keep=20).logits, full)  # more than there are: all
    per_row = torch.tensor([[1, 7], [3, 2]])
    torch.testing.assert_close(model(ids, logits_to_keep=per_row).logits, torch.stack([full[0, [1, 7]], full[1, [3, 2]]]))
    chosen = torch.zeros(2, 8, dtype=torch.bool)
    chosen[0, 2], chosen[1, 4:6] = True, True
    torch.testing.assert_close(model(ids, logits_to_keep=chosen).logits, full[chosen])
    for bad in (-1, True, 1.5, torch.zeros(2, 2, 2, dtype=torch.long)):
        with pytest.raises(ValueError, match="logits_to_keep must be"):
            model(ids, logits_to_keep=bad)


# ----------------------------------------------------------------------------- training


def _gradients(model: TrellisForCausalLM, ids: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_padded_batch_gradients_are_the_sum_of_the_rows_gradients():
    model = tiny_model(seed=3, chunk_size=3).train()

    def summed_loss_gradients(ids, mask):
        model.zero_grad()
        labels = ids.masked_fill(mask == 0, -100)
        model(ids, attention_mask=mask, labels=labels, num_items_in_batch=1).loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters()}

    rows = [random_tokens(1, n, seed=n)[0] for n in (8, 3, 5)]
    batch = summed_loss_gradients(*right_pad(rows))
    per_row = [summed_loss_gradients(r[None], torch.ones(1, len(r), dtype=torch.long)) for r in rows]
    for name, grad in batch.items():
        torch.testing.assert_close(grad, sum(g[name] for g in per_row), rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_activation_checkpointing_gives_the_same_gradients(schedule):
    model = tiny_model(schedule=schedule).train()
    ids, mask = left_pad([random_tokens(1, 9)[0], random_tokens(1, 6, seed=1)[0]])
    plain = _gradients(model, ids, mask)
    enable_checkpointing(model)
    assert is_checkpointing(model)
    checkpointed = _gradients(model, ids, mask)
    assert plain.keys() == checkpointed.keys()
    # A parameter that only the op reads gets its gradient through the checkpointed op too.
    op_parameter = {"trellis": "mk0", "lattice": "s0", "kvm": "temperature"}[SCHEDULES[schedule][0]]
    assert f"model.layers.0.self_attn.{op_parameter}" in plain.keys()
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], msg=name)


# bf16 logits against float32's, relative to the largest float32 logit (see the test below).
BF16_BOUND = 0.02


def test_bfloat16_forward_and_generate():
    """A bf16 model against float32 arithmetic on its own (rounded) weights: the padded forward's
    logits and every decode step's within BF16_BOUND of the largest logit (a bf16 rounding is up to
    0.4 %, and a few add up through the layers: measured up to 1.5 % on ten seeds), and each greedy
    token float32's choice wherever float32's two best logits are further apart than twice that."""
    model = tiny_model(dtype=torch.bfloat16, eos_token_id=None)
    in_float32 = tiny_model(dtype=torch.bfloat16).float()
    ids, mask = left_pad([random_tokens(1, 7)[0], random_tokens(1, 5, seed=1)[0]])
    out = model(ids, attention_mask=mask)
    assert out.logits.dtype == torch.bfloat16 and torch.isfinite(out.logits).all()
    state = cache_of(out).layers[0].state
    assert state.m_k.dtype == torch.float32  # the memories stay float32
    with torch.no_grad():
        want = in_float32(ids, attention_mask=mask).logits
    bound = BF16_BOUND * want.abs().max()
    assert (out.logits.float() - want)[mask.bool()].abs().max() <= bound
    generated = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, output_logits=True,
                               return_dict_in_generate=True)
    tokens = generated.sequences
    assert tokens.shape == (2, 17)
    with torch.no_grad():  # float32 on the same tokens, each step's logits at the token before it
        want = in_float32(tokens, attention_mask=F.pad(mask, (0, 10), value=1)).logits[:, 6:-1]
    assert (torch.stack(generated.logits, dim=1).float() - want).abs().max() <= bound
    best, second = want.topk(2).values.unbind(-1)
    decided = best - second > 2 * bound
    assert decided.float().mean() > 0.5  # most steps: the check below is not an empty one
    assert torch.equal(tokens[:, 7:][decided], want.argmax(-1)[decided])


def test_op_backends_agree_in_float64():
    model = tiny_model(dtype=torch.float64, chunk_size=3)
    ids, mask = left_pad([random_tokens(1, 8)[0], random_tokens(1, 5, seed=1)[0]])
    by_backend = {}
    for backend in ("reference", "torch"):
        model.config.op_backend = backend
        by_backend[backend] = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(by_backend["torch"], by_backend["reference"], rtol=1e-10, atol=1e-10)


# ----------------------------------------------------------------------------- init and checkpoints


def test_initialisation():
    model = tiny_model(num_heads=4, head_dim=8, hidden_size=64, num_slots=16, initializer_range=0.05)
    attn = model.model.layers[0].self_attn
    beta = torch.exp(F.logsigmoid(attn.beta_proj.bias.double()) / model.config.gate_logit_normalizer)
    torch.testing.assert_close(beta[[0, -1]], torch.tensor([0.9, 0.999], dtype=torch.float64))
    assert torch.all(beta[1:] > beta[:-1])  # one time scale per head
    one_head = torch.exp(F.logsigmoid(forget_gate_bias(1, 16.0)) / 16.0)
    torch.testing.assert_close(one_head, torch.tensor([0.99], dtype=torch.float64))
    assert torch.equal(attn.gamma_proj.bias, torch.zeros(4))
    assert 0.8 < attn.mk0.std() < 1.2 and 0.8 < attn.mv0.std() < 1.2
    assert 0.04 < attn.q_proj.weight.std() < 0.06
    # Compression targets of unit variance per slot for a unit-RMS input, as phi outputs them.
    alpha = attn.alpha_proj(F.rms_norm(torch.randn(256, 64), (64,)))
    assert 0.85 < alpha.std() < 1.15
    assert torch.equal(attn.o_norm.weight, torch.ones(8)) and torch.equal(model.model.norm.weight, torch.ones(64))


def test_tied_embeddings():
    tied = tiny_model(tie_word_embeddings=True)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    untied = tiny_model()  # the default: an untied head (see the config's docstring)
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight


@pytest.mark.parametrize("tie", [True, False])
def test_save_and_load_give_identical_logits(tmp_path, tie):
    model = tiny_model(tie_word_embeddings=tie)
    model.save_pretrained(tmp_path)
    assert ("lm_head.weight" in load_file(tmp_path / "model.safetensors")) is not tie
    ids = random_tokens(2, 9)
    for loaded in (AutoModelForCausalLM.from_pretrained(tmp_path), TrellisForCausalLM.from_pretrained(tmp_path)):
        assert type(loaded) is TrellisForCausalLM and not loaded.training
        for name, tensor in model.state_dict().items():
            assert torch.equal(loaded.state_dict()[name], tensor), name
        assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) is tie
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    base = AutoModel.from_pretrained(tmp_path)
    assert type(base) is TrellisModel
    torch.testing.assert_close(base(ids).last_hidden_state, model.model(ids).last_hidden_state, rtol=0, atol=0)


def test_device_map_loading(tmp_path):
    pytest.importorskip("accelerate")
    model = tiny_model()
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, device_map="auto")
    ids, mask = left_pad([random_tokens(1, 6)[0], random_tokens(1, 2, seed=1)[0]])
    torch.testing.assert_close(loaded(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits)
    assert torch.equal(
        loaded.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False),
        model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False),
    )


def test_loading_initialises_what_the_checkpoint_lacks(tmp_path):
    # Models are built on the meta device; missing tensors must get the real init, not junk.
    model = tiny_model()
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    dropped = ("model.layers.1.self_attn.mk0", "model.layers.1.self_attn.beta_proj.bias", "model.layers.1.self_attn.q_conv.weight")
    save_file({k: v for k, v in weights.items() if k not in dropped}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    loaded = TrellisForCausalLM.from_pretrained(tmp_path)
    attn = loaded.model.layers[1].self_attn
    torch.testing.assert_close(attn.beta_proj.bias, forget_gate_bias(2, 16.0).float())
    assert 0.6 < attn.mk0.std() < 1.4 and torch.isfinite(attn.mk0).all()
    torch.testing.assert_close(attn.q_conv.weight, attn.q_conv.delay_taps(0))  # the from-scratch init
    for name, tensor in model.state_dict().items():  # the rest is what was saved
        if name not in dropped:
            assert torch.equal(loaded.state_dict()[name], tensor), name


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_lora_adapters_train_save_load_generate_and_merge(tmp_path, schedule):
    peft = pytest.importorskip("peft")
    from trellis_lm.training import LORA_TARGET_MODULES

    model = tiny_model(schedule=schedule)
    ids, mask = left_pad([random_tokens(1, 6)[0], random_tokens(1, 4, seed=1)[0]])
    base_logits = model(ids, attention_mask=mask).logits
    lora = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=list(LORA_TARGET_MODULES)))
    for layer in lora.base_model.model.model.layers:  # every documented target a block has is adapted
        for target in LORA_TARGET_MODULES:
            block_part = layer.mlp if target in ("gate_proj", "up_proj", "down_proj") else layer.self_attn
            if target in ("q_proj", "k_proj", "v_proj", "o_proj") or hasattr(block_part, target):
                assert isinstance(getattr(block_part, target), peft.tuners.lora.LoraLayer), target
        if hasattr(layer.self_attn, "merge_proj"):  # KVM's merge gate is not a target (nor named as the MLP's)
            assert not isinstance(layer.self_attn.merge_proj, peft.tuners.lora.LoraLayer)
    assert all("lora_" in name for name, p in lora.named_parameters() if p.requires_grad)
    torch.testing.assert_close(lora(input_ids=ids, attention_mask=mask).logits, base_logits)  # B starts at zero

    optimizer = torch.optim.SGD([p for p in lora.parameters() if p.requires_grad], lr=1.0)
    lora.train()
    lora(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss.backward()
    optimizer.step()
    lora.eval()
    with torch.no_grad():  # both without a graph: the ops' CPU backend is then one (a graph takes the chunk form)
        adapted = lora(input_ids=ids, attention_mask=mask).logits
    assert not torch.allclose(adapted, base_logits, atol=1e-3)

    lora.save_pretrained(tmp_path)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in tmp_path.iterdir()}
    reloaded = peft.PeftModel.from_pretrained(tiny_model(schedule=schedule), tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids, attention_mask=mask).logits, adapted, rtol=0, atol=0)
    generate = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert torch.equal(reloaded.generate(**generate), lora.generate(**generate))
    merged = reloaded.merge_and_unload()
    assert type(merged) is TrellisForCausalLM
    torch.testing.assert_close(merged(ids, attention_mask=mask).logits, adapted, **TOL)


def test_short_conv_is_a_causal_depthwise_conv1d():
    from trellis_lm.mixers.norms_convs import TrellisShortConv

    conv = TrellisShortConv(channels=6, width=4)
    torch.nn.init.normal_(conv.weight)
    x = torch.randn(2, 9, 6)
    expected = torch.nn.functional.conv1d(
        torch.nn.functional.pad(x.transpose(1, 2), (3, 0)), conv.weight, groups=6
    ).transpose(1, 2)
    y, tail = conv(x, None)
    torch.testing.assert_close(y, expected)
    torch.testing.assert_close(tail, x[:, -3:])
    # Continuing from the tail equals convolving the whole sequence.
    y1, tail1 = conv(x[:, :5], None)
    y2, _ = conv(x[:, 5:], tail1)
    torch.testing.assert_close(torch.cat([y1, y2], dim=1), expected)


@pytest.mark.parametrize("mixer, width", [("trellis", 4), ("lattice", 4), ("trellis", 2), ("trellis", 1)])
def test_fresh_short_convs_pass_the_current_token_to_q_and_the_previous_to_k(mixer, width):
    model = TrellisForCausalLM(tiny_config(mixer_types=(mixer,), num_hidden_layers=1, conv_size=width))
    attn = model.model.layers[0].self_attn
    x = torch.randn(2, 7, attn.k_conv.weight.shape[0])
    q, _ = attn.q_conv(x, None)
    k, _ = attn.k_conv(x, None)
    torch.testing.assert_close(q, x, rtol=0, atol=0)
    if width == 1:  # no earlier token in reach: k passes the current one too
        torch.testing.assert_close(k, x, rtol=0, atol=0)
    else:
        torch.testing.assert_close(k[:, 1:], x[:, :-1], rtol=0, atol=0)
        assert not k[:, 0].any()


def test_delay_taps_refuse_a_lag_outside_the_conv():
    from trellis_lm.mixers.norms_convs import TrellisShortConv

    conv = TrellisShortConv(channels=3, width=4)
    assert conv.delay_taps(3)[..., 0].eq(1).all() and conv.delay_taps(3).sum() == 3
    for lag in (-1, 4):
        with pytest.raises(ValueError, match=r"lag must be in \[0, 3\]"):
            conv.delay_taps(lag)


def test_the_delta_rule_stays_finite_on_long_inputs():
    # With stale anchors, identity compression gave NaN logits after ~2.4k random tokens at C = 64
    # (and ~800 repetitions of one token); the exact gated delta rule stays bounded.
    model = tiny_model(compress_fn="identity", chunk_size=64)
    with torch.no_grad():
        for ids in (random_tokens(1, 4096, seed=1), torch.full((1, 4096), 7)):
            assert torch.isfinite(model(ids).logits).all()


def test_inference_after_fused_adamw_steps_uses_the_new_weights():
    # Fused AdamW (the Trainer's default) updates parameters without moving their version
    # counters: an inference path that cached anything derived from the weights would go stale.
    model = tiny_model(seed=4)
    ids = random_tokens(2, 9)
    with torch.no_grad():
        model(ids)  # an inference forward first, as an evaluation loop would run
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    model.train()
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    model.eval()
    with torch.no_grad():
        after = model(ids).logits
    fresh = tiny_model(seed=4)
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(after, fresh(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("schedule", ["trellis", "lattice", "kvm"])
def test_padded_rows_keep_the_op_output_dtype_when_values_differ(schedule, monkeypatch):
    """Under CUDA autocast a layer's values can be bf16 while its queries are float32 (norms run
    in float32 there), and the op answers in the queries' dtype: with padding, the packed op's
    output goes back in that dtype (a padded bf16 Trainer step on a GPU failed here)."""
    model = tiny_model(schedule=schedule)
    mixer = model.model.layers[0].self_attn
    attend, seen = mixer._attend, {}

    def capture(inputs, initial_state, valid, keep_state, consume_state=False):
        seen.update(inputs=inputs, initial_state=initial_state, valid=valid)
        return attend(inputs, initial_state, valid, keep_state, consume_state)

    monkeypatch.setattr(mixer, "_attend", capture)
    ids, mask = right_pad([random_tokens(1, 9, seed=1)[0], random_tokens(1, 5, seed=2)[0]])
    model(input_ids=ids, attention_mask=mask)
    inputs = list(seen["inputs"])
    inputs[2] = inputs[2].bfloat16()  # the values
    o, _ = attend(tuple(inputs), seen["initial_state"], seen["valid"], False)
    o_all, _ = attend(tuple(inputs), seen["initial_state"], None, False)  # right padding: causal, same tokens
    assert o.dtype == o_all.dtype
    valid = mask.bool()
    torch.testing.assert_close(o[valid], o_all[valid])
    assert not o[~valid].any()
