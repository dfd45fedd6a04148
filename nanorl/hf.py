"""
Hugging Face checkpoints in and out of nanorl's GPT.

Import: a local directory with config.json + *.safetensors (one file, or shards listed in
model.safetensors.index.json) of a Llama-3, Qwen2/Qwen2.5, Qwen3 or NanoChat model becomes a GPT with the
matching config switches. The model is built on the meta device and each shard's tensors are assigned
straight into it one shard at a time, so loading never holds more than the model plus one shard.
Export: any GPT back to a directory that transformers' AutoModelForCausalLM loads: nanorl's own
architecture as NanoChatForCausalLM, imported models in their own architecture. An export is written beside its
target and renamed into place, and replaces only an earlier export (its marker file lists what it wrote), never a
directory we did not write.

Rotary: nanorl rotates the pair (x[i], x[i + d/2]) by +angle, as Llama/Qwen do, so their q/k weights load
unchanged. NanoChatForCausalLM rotates the same pairs by -angle; negating the second half of each q/k head
turns one into the other (q.k is unchanged because both sides flip, and the parameter-free QK-norm does not
see the sign), so the conversion flips those rows both ways.
"""

import json
import os
import re
import shutil
import tempfile
from contextlib import contextmanager

import torch

from nanorl.errors import BadValue, MissingFile, Unreadable, read_json_object
from nanorl.gpt import GPT, GPTConfig
from nanorl.precision import low_precision_dtype

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "NanoChatForCausalLM")
MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "nanochat": "NanoChatForCausalLM",
}  # config.json's model_type -> the architecture it names

# HF parameter name (per layer, after "model.layers.{i}.") -> nanorl's (after "transformer.h.{i}.")
LAYER_NAMES = {
    "self_attn.q_proj": "attn.c_q",
    "self_attn.k_proj": "attn.c_k",
    "self_attn.v_proj": "attn.c_v",
    "self_attn.o_proj": "attn.c_proj",
    "self_attn.q_norm": "attn.q_norm",
    "self_attn.k_norm": "attn.k_norm",
    "mlp.gate_proj": "mlp.c_gate",
    "mlp.up_proj": "mlp.c_fc",
    "mlp.down_proj": "mlp.c_proj",
    "mlp.fc1": "mlp.c_fc",
    "mlp.fc2": "mlp.c_proj",  # NanoChat's ReLU^2 MLP
    "input_layernorm": "norm_attn",
    "post_attention_layernorm": "norm_mlp",
}
TOP_NAMES = {"model.embed_tokens": "transformer.wte", "model.norm": "transformer.norm_f", "lm_head": "lm_head"}


def architecture(cfg, path):
    """The architecture config.json names in `architectures[0]` or `model_type` (either is enough); one that is not
    supported, or the two naming different ones, is refused in one line naming the file."""
    listed = cfg.get("architectures")
    arch = listed[0] if isinstance(listed, list) and listed else None
    model_type = cfg.get("model_type")
    if arch is None and model_type is None:
        raise BadValue(f"{path} names no architecture (neither 'architectures' nor 'model_type')")
    if arch is None and model_type not in MODEL_TYPES:
        raise BadValue(f"{path}: model_type {model_type!r} is not supported (supported: {', '.join(MODEL_TYPES)})")
    arch = arch or MODEL_TYPES[model_type]
    if arch not in ARCHITECTURES:
        raise BadValue(f"{path}: architecture {arch} is not supported (supported: {', '.join(ARCHITECTURES)})")
    if model_type is not None and MODEL_TYPES.get(model_type) != arch:
        raise BadValue(
            f"{path}: architectures[0] {arch} contradicts model_type {model_type!r} "
            f"(a {arch} has model_type {next(t for t, a in MODEL_TYPES.items() if a == arch)!r})"
        )
    return arch


CONFIG_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def read_config(directory):
    """config.json of a HF model directory, with one-line errors naming the file. Its architecture is resolved
    (from `architectures[0]` or `model_type`) into `architectures`, where the rest of this module reads it."""
    if not os.path.isdir(directory):
        raise MissingFile(f"--hf-model {directory}: no such directory")
    path = os.path.join(directory, "config.json")
    if not os.path.exists(path):
        raise MissingFile(f"{path} is missing: not a Hugging Face model directory")
    cfg = read_json_object(path, "model config")
    cfg["architectures"] = [architecture(cfg, path)]
    missing = [k for k in CONFIG_KEYS if not isinstance(cfg.get(k), int)]
    if missing:
        raise BadValue(
            f"{path} lacks {', '.join(missing)} (or they are not integers): it cannot say which model to build"
        )
    return cfg


def read_generation_config(directory):
    """generation_config.json of a HF model directory ({} when there is none)."""
    path = os.path.join(directory, "generation_config.json")
    return read_json_object(path, "generation config") if os.path.exists(path) else {}


def gpt_config(cfg, path, sequence_len=None):
    """A HF config dict -> GPTConfig with the switches that reproduce that architecture exactly."""
    arch = cfg["architectures"][0]
    nanochat = arch == "NanoChatForCausalLM"
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    # what this loader cannot reproduce is refused, never silently approximated
    unsupported = []
    if rope_type not in ("default", "llama3"):
        unsupported.append(f"rope_type {rope_type}")
    if cfg.get("hidden_act", "relu2" if nanochat else "silu") != ("relu2" if nanochat else "silu"):
        unsupported.append(f"hidden_act {cfg.get('hidden_act')}")
    if cfg.get("use_sliding_window") or (arch == "LlamaForCausalLM" and cfg.get("sliding_window")):
        unsupported.append("sliding-window attention")
    if cfg.get("mlp_bias"):
        unsupported.append("mlp_bias")
    if cfg.get("attention_bias") and arch != "Qwen2ForCausalLM":
        unsupported.append("attention_bias (a bias on o_proj)")
    if unsupported:
        raise BadValue(f"{path}: {arch} with {', '.join(unsupported)} is not supported")
    n_head = cfg["num_attention_heads"]
    max_pos = cfg.get("max_position_embeddings", 2048)
    return GPTConfig(
        # rotary tables and the engine's default KV cache are sized by sequence_len: a 128k-context model
        # starts at 8k unless the caller asks for more
        sequence_len=sequence_len or min(max_pos, 8192),
        vocab_size=cfg["vocab_size"],
        n_layer=cfg["num_hidden_layers"],
        n_head=n_head,
        n_kv_head=cfg.get("num_key_value_heads") or n_head,
        n_embd=cfg["hidden_size"],
        softcap=(cfg.get("final_logit_softcapping") or 0.0) if nanochat else 0.0,
        head_dim=cfg.get("head_dim") or 0,
        mlp="relu2" if nanochat else "swiglu",
        mlp_hidden=cfg["intermediate_size"],
        norm_weight=not nanochat,
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        attn_bias=arch == "Qwen2ForCausalLM",
        qk_norm=arch in ("Qwen3ForCausalLM", "NanoChatForCausalLM"),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope_theta=theta,
        rope_scaling=rope if rope_type == "llama3" else None,
    )


def flip_rotary_half(w, head_dim):
    """Negate the second half of each head's rows (q/k projection weight or bias): +angle <-> -angle rotary."""
    shape = w.shape
    w = w.reshape(-1, head_dim, *shape[1:]).clone()
    w[:, head_dim // 2 :] *= -1
    return w.reshape(shape)


def nanorl_name(hf_name):
    """HF parameter name -> nanorl's, or None for a name nanorl has no place for."""
    m = re.match(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)$", hf_name)
    if m and m.group(2) in LAYER_NAMES:
        return f"transformer.h.{m.group(1)}.{LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    m = re.match(r"(.+)\.(weight|bias)$", hf_name)
    if m and m.group(1) in TOP_NAMES:
        return f"{TOP_NAMES[m.group(1)]}.{m.group(2)}"
    return None


def shard_files(directory):
    """The safetensors files of a HF directory, checked against the shard index when there is one."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        weight_map = read_json_object(index, "shard index").get("weight_map")
        if not isinstance(weight_map, dict):
            raise Unreadable(f"shard index {index} is corrupt: it has no 'weight_map' object")
        files = sorted(set(weight_map.values()))
        for name in files:
            if not os.path.exists(os.path.join(directory, name)):
                raise MissingFile(f"{index} lists shard {name}, which is not in {directory}")
        return [os.path.join(directory, name) for name in files], weight_map
    single = os.path.join(directory, "model.safetensors")
    if not os.path.exists(single):
        raise MissingFile(f"{single} is missing (and there is no model.safetensors.index.json)")
    return [single], None


def load_hf_model(directory, device="cpu", dtype=None, sequence_len=None):
    """
    A HF model directory -> (GPT in eval mode, its HF config dict). dtype: default bf16 on CUDA, fp32
    elsewhere. Tensors go from each shard straight into the meta-built model (assign, no second copy).
    """
    from safetensors import safe_open

    cfg = read_config(directory)
    config_path = os.path.join(directory, "config.json")
    config = gpt_config(cfg, config_path, sequence_len)
    device = torch.device(device)
    dtype = dtype or low_precision_dtype(device)
    with torch.device("meta"):
        model = GPT(config)
    expected = set(model.state_dict())
    files, weight_map = shard_files(directory)
    nanochat = cfg["architectures"][0] == "NanoChatForCausalLM"
    loaded = set()
    for path in files:
        try:  # a truncated or empty file fails here, on its header
            shard = safe_open(path, framework="pt", device="cpu")
        except Exception as e:  # noqa: BLE001 - safetensors' own error class, or an OSError
            raise Unreadable(f"{path} is corrupt or truncated ({type(e).__name__}: {str(e).strip()[:200]})") from e
        with shard as f:
            keys = list(f.keys())
            if weight_map is not None:
                listed = {k for k, v in weight_map.items() if v == os.path.basename(path)}
                if set(keys) != listed:
                    missing, extra = sorted(listed - set(keys)), sorted(set(keys) - listed)
                    raise BadValue(
                        f"{path} does not match model.safetensors.index.json: "
                        f"missing {missing[:3]}, unlisted {extra[:3]}"
                    )
            part = {}
            for key in keys:
                name = nanorl_name(key)
                if name is None or (name == "lm_head.weight" and config.tie_embeddings):
                    if name is None and not key.endswith("rotary_emb.inv_freq"):
                        raise BadValue(f"{path}: tensor {key} has no place in a {cfg['architectures'][0]} model")
                    continue
                if name not in expected:
                    raise BadValue(f"{path}: tensor {key} does not fit this config ({config_path})")
                t = f.get_tensor(key)
                if nanochat and name.split(".")[-2] in ("c_q", "c_k"):
                    t = flip_rotary_half(t, model.head_dim)
                part[name] = t.to(device=device, dtype=dtype)
            model.load_state_dict(part, strict=False, assign=True)
            loaded |= set(part)
    if config.tie_embeddings:
        loaded.add("lm_head.weight")
    if loaded != expected:
        missing = sorted(expected - loaded)
        raise BadValue(f"{directory}: the safetensors files lack {len(missing)} tensors, e.g. {missing[:3]}")
    model.tie_weights()
    model.init_rotary()
    model.eval()
    return model, cfg


def token_ids(tokenizer, source=None):
    """bos/eos/pad ids of an export: the source model's own where it declared them (every id of an eos list, its
    pad token), else the tokenizer's (padding with the end of a reply); the tokenizer's end of a reply is always among
    the eos ids, so a model chat-trained from a base model stops where it learned to. Not padding with bos: every
    prompt starts with it, and transformers' generate, given no attention mask, masks out each prompt token equal to
    the pad id (unless that id is an eos), so the model would answer a prompt without its first token."""
    ids = {}
    if tokenizer is not None:
        ids = {
            "bos_token_id": tokenizer.get_bos_token_id(),
            "eos_token_id": tokenizer.encode_special("<|assistant_end|>"),
            "pad_token_id": tokenizer.encode_special("<|assistant_end|>"),
        }
    ids.update(
        {
            k: v
            for k, v in (source or {}).items()
            if k in ("bos_token_id", "eos_token_id", "pad_token_id") and v is not None
        }
    )
    end = tokenizer.encode_special("<|assistant_end|>") if tokenizer is not None else None
    eos = ids.get("eos_token_id")
    if isinstance(eos, list) and end is not None and end not in eos:
        ids["eos_token_id"] = eos + [end]
    elif isinstance(eos, int) and end is not None and eos != end:
        ids["eos_token_id"] = [eos, end]
    return ids


def generation_config(tokenizer, source_config=None, source_generation=None):
    """generation_config.json: the source model's settings (sampling defaults included) with the token ids above."""
    gen = {
        k: v for k, v in (source_generation or {}).items() if k not in ("transformers_version", "_from_model_config")
    }
    return {**gen, **token_ids(tokenizer, {**(source_config or {}), **gen})}


def hf_config(model, tokenizer=None, source=None):
    """config.json for a GPT: its own architecture if imported, else NanoChatForCausalLM. source: the config.json
    it was imported from, whose declared context and special token ids the export keeps (the import caps the
    context it computes rotary tables for at 8,192; the model itself still has its declared one)."""
    c = model.config
    nanochat = not c.norm_weight
    if nanochat and not (c.mlp == "relu2" and c.qk_norm and not c.attn_bias and c.rope_scaling is None):
        raise ValueError(
            "this model mixes nanorl's parameter-free norms with imported switches: no HF architecture fits"
        )
    arch = (
        "NanoChatForCausalLM"
        if nanochat
        else "Qwen2ForCausalLM"
        if c.attn_bias
        else "Qwen3ForCausalLM"
        if c.qk_norm
        else "LlamaForCausalLM"
    )
    rope = {"rope_theta": c.rope_theta, "rope_type": "default"}
    if c.rope_scaling:
        rope = {**c.rope_scaling, "rope_theta": c.rope_theta, "rope_type": "llama3"}
    out = {
        "architectures": [arch],
        "model_type": {
            "NanoChatForCausalLM": "nanochat",
            "Qwen2ForCausalLM": "qwen2",
            "Qwen3ForCausalLM": "qwen3",
            "LlamaForCausalLM": "llama",
        }[arch],
        "vocab_size": c.vocab_size,
        "hidden_size": c.n_embd,
        "intermediate_size": c.mlp_hidden or 4 * c.n_embd,
        "num_hidden_layers": c.n_layer,
        "num_attention_heads": c.n_head,
        "num_key_value_heads": c.n_kv_head,
        "head_dim": model.head_dim,
        "max_position_embeddings": max(c.sequence_len, (source or {}).get("max_position_embeddings") or 0),
        "hidden_act": "relu2" if nanochat else "silu",
        # nanorl's norm uses the dtype's epsilon when norm_eps is 0: write the fp32 value so fp32 logits agree
        "rms_norm_eps": c.norm_eps or torch.finfo(torch.float32).eps,
        "rope_parameters": rope,
        "tie_word_embeddings": c.tie_embeddings,
        "attention_bias": False,
        "dtype": "float32",
    }
    if nanochat:
        out["final_logit_softcapping"] = c.softcap or None
    out.update(token_ids(tokenizer, source))
    return out


def hf_state_dict(model):
    """nanorl's state dict under HF names (q/k rows flipped for NanoChat; the tied lm_head left out)."""
    inverse_layer = {v: k for k, v in LAYER_NAMES.items() if not k.startswith("mlp.fc")}
    nanochat = not model.config.norm_weight
    if nanochat:
        inverse_layer.update({"mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2"})
    inverse_top = {v: k for k, v in TOP_NAMES.items()}
    out = {}
    for name, t in model.state_dict().items():
        name = name.removeprefix("_orig_mod.")
        if name == "lm_head.weight" and model.config.tie_embeddings:
            continue
        m = re.match(r"transformer\.h\.(\d+)\.(.+)\.(weight|bias)$", name)
        if m:
            hf = f"model.layers.{m.group(1)}.{inverse_layer[m.group(2)]}.{m.group(3)}"
            if nanochat and m.group(2) in ("attn.c_q", "attn.c_k"):
                t = flip_rotary_half(t, model.head_dim)
        else:
            prefix, kind = name.rsplit(".", 1)
            hf = f"{inverse_top[prefix]}.{kind}"
        out[hf] = t.detach().to("cpu").contiguous()
    return out


# -----------------------------------------------------------------------------------------------
# the export directory: an export replaces only what an earlier export wrote

EXPORT_MARKER = "nanorl_export.json"  # in every export: the files it wrote, all that --force may replace


def export_files(directory):
    """The files an earlier export wrote into directory (its marker's list), or None when it holds no marker of ours."""
    try:
        with open(os.path.join(directory, EXPORT_MARKER)) as f:
            files = json.load(f).get("files")
    except (OSError, ValueError, AttributeError):
        return None
    return set(files) if isinstance(files, list) and all(isinstance(x, str) for x in files) else None


def check_export_dir(out_dir, force=False):
    """Refuse, in one line, a target an export must not replace: the current, home or repository directory or any
    directory holding one of them (e.g. /), a file or link, a directory that is not empty and is not an earlier
    export (its marker lists every file in it), or an earlier export without force. Absent or empty: fine."""
    real = os.path.realpath(out_dir)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    kept = {
        "the current directory": os.getcwd(),
        "your home directory": os.path.expanduser("~"),
        "the repository": repo,
    }
    for what, path in kept.items():
        path = os.path.realpath(path)
        if path == real:
            raise BadValue(f"-o {out_dir} is {what} ({real}): an export never replaces it; name a new directory")
        if os.path.commonpath([path, real]) == real:
            raise BadValue(f"-o {out_dir} ({real}) holds {what}: an export never replaces it; name a new directory")
    if not os.path.lexists(out_dir):
        return
    if os.path.islink(out_dir) or not os.path.isdir(out_dir):
        raise BadValue(
            f"-o {out_dir} is a {'link' if os.path.islink(out_dir) else 'file'}, not a directory: name a new one"
        )
    names = set(os.listdir(out_dir))
    if not names:
        return
    ours = export_files(out_dir)
    if ours is None:
        raise BadValue(
            f"-o {out_dir} is not empty ({len(names)} entries) and is not an earlier export (no {EXPORT_MARKER}): "
            "name a new or empty directory"
        )
    others = sorted(names - ours - {EXPORT_MARKER})
    if others:
        raise BadValue(
            f"-o {out_dir} holds an earlier export and {len(others)} entries it did not write ({', '.join(others[:3])}"
            f"{' ...' if len(others) > 3 else ''}): they would be lost; move them or name another directory"
        )
    if not force:
        raise BadValue(f"-o {out_dir} holds an earlier export: --force replaces it, or name another directory")


@contextmanager
def export_directory(out_dir, force=False):
    """Yield a fresh temp directory beside out_dir to write an export into; when the body finishes it becomes out_dir
    with a marker listing its files, and only then does an earlier export there go (check_export_dir says which
    targets are refused, before anything is written). A failure removes the temp directory and leaves out_dir as
    it was."""
    check_export_dir(out_dir, force)
    parent, name = os.path.split(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=f".{name}.tmp-")
    old = None
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would hide the export from the other users of a shared disk
        yield tmp
        with open(os.path.join(tmp, EXPORT_MARKER), "w") as f:
            json.dump({"written_by": "nanorl", "files": sorted(os.listdir(tmp))}, f, indent=2)
        check_export_dir(out_dir, force)  # again: the writing took a while, and out_dir may have changed meanwhile
        if os.path.isdir(out_dir) and os.listdir(out_dir):  # an earlier export: moved aside, deleted once replaced
            old = tempfile.mkdtemp(dir=parent, prefix=f".{name}.old-")
            os.replace(out_dir, old)
        try:
            os.replace(tmp, out_dir)  # an empty directory is replaced by the rename itself
        except OSError:
            if old is not None:
                os.replace(old, out_dir)
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old)


def export_hf(model, tokenizer, out_dir, dtype=None, source_config=None, source_generation=None, force=False):
    """Write model + tokenizer as a HF directory: model.safetensors, config.json, generation_config.json, tokenizer
    files. source_config / source_generation: the config.json and generation_config.json of the model it was
    imported from (a checkpoint's meta keeps them), whose context, eos/pad ids and sampling defaults are kept.
    out_dir is claimed as export_directory says (force: an earlier export there may be replaced)."""
    from safetensors.torch import save_file

    from nanorl.tokenizer import save_hf_tokenizer

    with export_directory(out_dir, force) as tmp:
        state = hf_state_dict(model)
        if dtype is not None:
            state = {k: v.to(dtype) for k, v in state.items()}
        save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        cfg = hf_config(model, tokenizer, source_config)
        if dtype is not None:
            cfg["dtype"] = str(dtype).removeprefix("torch.")
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
        with open(os.path.join(tmp, "generation_config.json"), "w") as f:
            json.dump(generation_config(tokenizer, source_config, source_generation), f, indent=2)
        save_hf_tokenizer(tokenizer, tmp)
    return out_dir
