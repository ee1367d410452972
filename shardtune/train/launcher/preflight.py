"""Every check that needs more than the config's own fields, before any process starts: the
layout on this world, the model, the data, the run folder, the checkpoint to resume. Imports no
torch (a bad input is one line and exit 2, not a rank's traceback)."""
from __future__ import annotations

import contextlib
import io
import logging
import math
import os
import tempfile
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from shardtune.catalog.models import MODELS, resolve_model_config, safetensors_files
from shardtune.devices import resolve_backend
from shardtune.errors import UserError, suggest
from shardtune.layout import Layout
from shardtune.rules.pipeline import check_pipeline, check_pipeline_model
from shardtune.train.data.dataset import check_dataset
from shardtune.train.durable.ckpt_files import resolve_resume

if TYPE_CHECKING:  # pydantic stays out of CLI start-up: train/commands.py imports this module
    from shardtune.config import ModelConfig, RunConfig

_DIR_HINT = "give another with --output-dir or output_dir=DIR"


def _check_writable(run_dir: Path) -> None:
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"output dir {str(run_dir)!r} is a file, not a folder; {_DIR_HINT}")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=run_dir):
            pass
    except OSError as e:
        raise UserError(f"output dir {str(run_dir)!r} cannot be written ({e.strerror or e}); {_DIR_HINT}") from None


def _check_model(model: ModelConfig, seq_len: int) -> None:
    name = model.name
    looks_like_path = name not in MODELS and ("/" in name or name.startswith((".", "~")))
    if (looks_like_path or model.architecture) and model.is_absent_folder:
        from shardtune.config.paths import hub_cache_dir

        cache = f" nor a model in the local Hugging Face cache ({str(hub_cache_dir())!r})" if name.count("/") == 1 \
            and not name.startswith((".", "~")) else ""
        raise UserError(f"model path {name!r} does not exist{cache}" + (model.download_hint() or
                        "; give an HF model folder (config.json + safetensors) or a catalogue name"))
    hf = resolve_model_config(name)
    if model.architecture and name not in MODELS:
        _check_architecture(name, hf, model.architecture)
    if model.init == "pretrained" and not safetensors_files(name):
        raise UserError(f"model.init is 'pretrained' but {name!r} has no *.safetensors; "
                        "give an HF model folder with weights or set model.init=random")
    if name not in MODELS:  # the catalogue's entries are known causal LMs (and the check stays torch-free)
        check_hf_config(name, hf)
        _check_model_type(name, hf)
    _check_weights(model, hf)
    max_pos = hf.get("max_position_embeddings")
    if max_pos is not None and seq_len > max_pos:
        raise UserError(f"train.seq_len {seq_len} exceeds the model's max_position_embeddings {max_pos}; "
                        "lower train.seq_len")


def _check_architecture(name: str, hf: dict, architecture: str) -> None:
    """A folder that the recipe says is `architecture` has that architecture's shapes."""
    want = MODELS[architecture]["config"]
    keys = [k for k in _SIZES if k != "max_position_embeddings"] + ["tie_word_embeddings"]
    differ = [f"{k} {hf.get(k)} (not {want[k]})" for k in keys if k in want and hf.get(k, want[k]) != want[k]]
    if differ:
        raise UserError(f"model folder {name!r} is not model.architecture {architecture!r}: "
                        f"{', '.join(differ[:3])}; fix model.architecture or model.name")


PICKLE_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt")
_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "max_position_embeddings", "head_dim")


def _non_finite(value, where: str = "") -> str | None:
    """The first NaN / inf number in a JSON value (its key path), or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return where or "a value"
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        found = _non_finite(v, f"{where}.{k}" if where else str(k))
        if found:
            return found
    return None


def check_hf_config(name: str, hf: dict) -> None:
    """A model folder's config.json: every number finite, the sizes positive integers, the heads
    dividing as transformers' attention needs (HF would build a model of garbage, or fail in a rank)."""
    bad = _non_finite(hf)
    if bad:
        raise UserError(f"model {name!r}: config.json's {bad} is not a finite number; fix config.json")
    for key in _SIZES:
        v = hf.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise UserError(f"model {name!r}: config.json's {key} is {v!r}, not a positive integer; fix config.json")
    h, n, kv = hf.get("hidden_size"), hf.get("num_attention_heads"), hf.get("num_key_value_heads")
    if h and n and not hf.get("head_dim") and h % n:
        raise UserError(f"model {name!r}: config.json's hidden_size {h} is not divisible by num_attention_heads {n}; "
                        "fix config.json")
    if n and kv and n % kv:
        raise UserError(f"model {name!r}: config.json's num_attention_heads {n} is not a multiple of "
                        f"num_key_value_heads {kv}; fix config.json")


def _check_weights(model: ModelConfig, hf: dict) -> None:
    """A folder's weights: safetensors only (pickle is refused: it can run code); headers read with
    the `safetensors` library (no tensor loaded), every tensor's shape equal to the model the config
    builds. Lazy torch/transformers imports: only for a folder that has weights."""
    folder = Path(model.name).expanduser()
    if not folder.is_dir() or model.init == "random":
        return
    files = safetensors_files(model.name)
    if not files:
        pickled = sorted(p.name for pat in PICKLE_WEIGHTS for p in folder.glob(pat))
        if pickled:
            raise UserError(f"model folder {model.name!r} has pickle weights only ({', '.join(pickled[:3])}); "
                            "shardtune reads safetensors only (a pickle can run code): convert them (transformers' "
                            "save_pretrained(safe_serialization=True)) or set model.init=random")
        return
    _check_index(folder, files)
    from safetensors import SafetensorError, safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="numpy") as h:
                for k in h.keys():
                    shapes[k] = tuple(h.get_slice(k).get_shape())
        except (SafetensorError, OSError, ValueError) as e:
            raise UserError(f"weights file {str(f)!r} is not a readable safetensors file "
                            f"({' '.join(str(e).split())[:160]}); re-download or re-save it") from None
    from shardtune.train.core.model import build_meta_model  # torch: only for a folder with weights

    try:
        meta = build_meta_model(model)
    except UserError:
        raise
    except Exception as e:
        raise UserError(f"model {model.name!r}: transformers cannot build its config.json "
                        f"({type(e).__name__}: {' '.join(str(e).split())[:160]}); fix config.json") from None
    built = dict(meta.named_parameters())
    from shardtune.train.core.hub_layout import hub_sources  # the Hub's per-expert names: shapes checked there

    hub = hub_sources(meta.config, shapes) if any(n not in shapes for n in built) else {}
    for name, p in built.items():
        got = shapes.get(name)
        if got is None and name not in hub:
            raise UserError(f"weights in {model.name!r} lack tensor {name!r} that its config.json builds; give the "
                            "folder's matching config.json and weights")
        if got is not None and got != tuple(p.shape):
            raise UserError(f"weights in {model.name!r}: tensor {name!r} has shape {list(got)} but config.json "
                            f"builds {list(p.shape)}; give the folder's matching config.json and weights")
    # tensors the model does not build (e.g. layers config.json leaves out): tied heads and old rotary caches aside
    read = {k for _, srcs in hub.values() for k, _ in srcs}
    extra = sorted(k for k in shapes if k not in built and k not in read and k != "lm_head.weight"
                   and not k.endswith("inv_freq"))
    if extra:
        raise UserError(f"weights in {model.name!r} hold {len(extra)} tensor(s) its config.json does not build "
                        f"({extra[0]}); give the folder's matching config.json and weights")


def _check_index(folder: Path, files) -> None:
    """model.safetensors.index.json, when there is one: valid, and every shard it names present."""
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return
    from shardtune.errors import read_json_object

    fix = "re-download or re-save the model"
    weight_map = read_json_object(index, "weights index", fix).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise UserError(f"weights index {str(index)!r} has no weight_map of tensor → file; {fix}")
    missing = sorted(set(weight_map.values()) - {Path(f).name for f in files})
    if missing:
        raise UserError(f"weights index {str(index)!r} names {missing[0]}, which is not in the folder; {fix}")


def _check_model_type(name: str, hf: dict) -> None:
    model_type = hf.get("model_type")
    if not isinstance(model_type, str):
        raise UserError(f"model {name!r}: config.json has no model_type; give an HF config.json")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # the launcher may

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UserError(f"model {name!r}: model_type {model_type!r} is not a causal LM transformers knows"
                        f"{suggest(model_type, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)}; give a decoder model folder")


def _check_lora_targets(cfg: RunConfig) -> None:
    """lora.target_modules against the model's own modules (PEFT on the meta model, as the ranks do)."""
    from shardtune.train.core.lora import apply_lora  # torch: only for a LoRA run
    from shardtune.train.core.model import build_meta_model

    # PEFT's notices are not a line of ours; nor are torch's logged warnings when PEFT imports torchao
    # (torch.utils._pytree's handler holds the real stderr, so redirecting sys.stderr misses them)
    pytree = logging.getLogger("torch.utils._pytree")
    level = pytree.level
    pytree.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            apply_lora(build_meta_model(cfg.model), cfg.lora)
    finally:
        pytree.setLevel(level)


def _check_backend(backend: str, local_world_size: int) -> bool:
    """nccl needs CUDA and a GPU per local rank (devices.resolve_backend, as the ranks decide it);
    returns whether the ranks will use GPUs."""
    if resolve_backend(backend) != "nccl":
        return False
    import torch  # lazy: only where the ranks will use GPUs (torch-free start-up otherwise)

    if local_world_size > (count := torch.cuda.device_count()):
        raise UserError(f"{local_world_size} processes on this node, but it has {count} GPU(s): "
                        "give --nproc at most the GPU count (or train.backend=gloo for CPU ranks)")
    return True


def _available_host_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _check_model_states_fit(cfg: RunConfig, world_size: int, local_world_size: int, gpus: bool, planner) -> None:
    """The planner's model states per rank (params, grads, optimizer: exact, tests/dist) against this
    node's memory: the GPU's on a GPU run, the host's available memory for CPU ranks or offload
    'all' (every local rank's share). Only what surely cannot fit is refused (activations aside).
    `planner`: `shardtune.plan.plan`, handed down by the command (the trainer imports no planner);
    None: not checked."""
    if planner is None:
        return
    try:
        row = planner(gpus=world_size, gpus_per_node=local_world_size, strategies=[cfg.parallel.strategy],
                   **cfg.plan_inputs()).to_dict()["strategies"][0]["memory"]
    except Exception:  # a model the planner cannot price: the ranks' own limits stand
        return
    states = row["params"] + row["grads"] + row["optimizer"]
    gib = lambda n: f"{n / 2**30:,.1f} GiB"  # noqa: E731
    if gpus and cfg.parallel.offload == "none":
        import torch

        have = torch.cuda.get_device_properties(0).total_memory
        if states > have:
            raise UserError(f"{cfg.model.name} under {cfg.parallel.strategy} on {world_size} GPU(s) holds "
                            f"{gib(states)} of parameters, gradients and optimizer state per GPU (the planner's "
                            f"count), more than the GPU's {gib(have)}; see `shardtune plan` for a layout that fits")
        return
    have = _available_host_bytes()
    need = states * local_world_size
    if have is not None and need > have:
        where = "offloaded" if gpus else "CPU"
        raise UserError(f"{cfg.model.name} under {cfg.parallel.strategy} needs {gib(need)} of host memory for its "
                        f"{local_world_size} {where} rank(s)' parameters, gradients and optimizer state (the "
                        f"planner's count), more than this machine's {gib(have)} available; use more machines, "
                        "LoRA or a smaller model (`shardtune plan`)")


def _check_data_fills_a_batch(cfg: RunConfig, world_size: int) -> None:
    """Tokenizer, template and packing as every rank will: at least one global batch of rows (over
    every source of a mix with weight > 0). With a data.cache_dir folder the launcher builds the
    cache (a corrupt one is named and rebuilt here), so the ranks of this node only map it; with
    `auto` (the default) it reads a whole cache's rows, else counts without torch and one rank per
    node builds the cache."""
    from shardtune.train.data.dataset import build_tokenizer
    from shardtune.train.data.sources import source_configs

    tok = build_tokenizer(cfg.data, cfg.model.name, cfg.model.trust_remote_code)
    seq_len, rows_per_step = cfg.train.seq_len, cfg.train.micro_batch * cfg.train.grad_accum * world_size
    seed = cfg.train.seed if not cfg.data.sources else None
    rows = 0
    for k, (data, weight) in enumerate(source_configs(cfg.data)):
        seed_k = cfg.train.seed + k if seed is None else seed  # the seeds the ranks pack with (mix.py)
        if cfg.data.cache_dir == "auto":  # torch-free: a whole cache's rows, else counted here; a rank builds it
            from shardtune.train.data.dataset import cached_rows

            n = cached_rows(data, seq_len, tok, seed_k)
            n = _source_rows(data, tok, seq_len, rows_per_step, seed_k) if n is None else n
        elif cfg.data.cache_dir:  # build (or check and reuse) the ranks' cache now: they only map it
            from shardtune.train.data.dataset import build_dataset

            n = build_dataset(data, seq_len, tok, seed_k).num_rows
        else:
            n = _source_rows(data, tok, seq_len, rows_per_step, seed_k)
        rows += n if weight > 0 else 0
    if rows < rows_per_step:
        raise UserError(f"the dataset fills {rows} rows of seq_len {seq_len}, fewer than one "
                        f"global batch ({rows_per_step} = micro_batch × grad_accum × {world_size} ranks); add data "
                        "or lower train.micro_batch / grad_accum")


def _source_rows(data, tok, seq_len: int, rows_per_step: int, seed: int) -> int:
    """The rows one source packs into, or a bound >= rows_per_step when that is sure. Rows lie
    between ceil(kept tokens / seq_len) (perfect packing) and the kept examples; the seeded
    packing itself (torch's randperm) runs only when the batch falls between the two."""
    from shardtune.train.data.dataset import encode_records, read_records
    from shardtune.train.data.packing import pack_examples

    encoded = encode_records(read_records(data), tok, data)
    kept = [min(len(ids), seq_len) for ids, mask in encoded if any(mask[1:seq_len])]
    low = -(-sum(kept) // seq_len) if data.packing else len(kept)
    if kept and low >= rows_per_step:
        return len(kept)
    return pack_examples(encoded, seq_len, data.packing, seed, data.shuffle).num_rows  # no target at all: it says so


def _check_val(cfg: RunConfig) -> None:
    """data.val_path (or data.val_split's share) read, tokenized and packed as the ranks will: at least one
    target token."""
    from shardtune.train.data.dataset import build_tokenizer
    from shardtune.train.data.val import pack_val  # imports torch: only for a run with a val set

    pack_val(cfg.data, cfg.train.seq_len, build_tokenizer(cfg.data, cfg.model.name, cfg.model.trust_remote_code))


def check_environment(strategy: str, *, optimizer: str = "adamw", quantize_base: str = "none",
                      compile: bool = False) -> None:
    """What THIS machine must have for the run, one UserError each (the combination itself is
    rules.combination.check_combination's, which probes nothing: `plan` judges it for any machine)."""
    import importlib.util
    import shutil
    import sys

    from shardtune.strategies import STRATEGY

    if optimizer == "adamw-8bit":
        # bitsandbytes 0.50.2 refuses FSDP2's DTensor params ("got mixed torch.Tensor and
        # DTensor", measured); torchao's AdamW8bit takes them, so FSDP strategies use torchao
        package = "torchao" if STRATEGY[strategy].fsdp else "bitsandbytes"
        if importlib.util.find_spec(package) is None:
            raise UserError(f"optimizer 'adamw-8bit' under {strategy} needs {package} "
                            f"(pip install 'shardtune[8bit]'), or optim.name / --optimizer adamw")
    if quantize_base != "none" and importlib.util.find_spec("torchao") is None:
        raise UserError(f"quantize_base {quantize_base!r} (QLoRA) needs torchao's NF4Tensor "
                        "(pip install 'shardtune[8bit]'), or lora.quantize_base / --quantize-base none")
    if compile:
        # torch's inductor builds its CPU kernels with $CXX, else g++ (clang++ on macOS):
        # torch/_inductor/config.py `cpp.cxx`, cpp_builder.py `get_cpp_compiler`
        cxx = os.environ.get("CXX") or ("clang++" if sys.platform == "darwin" else "g++")
        if shutil.which(cxx) is None:
            raise UserError(f"train.compile needs a C++ compiler for torch.compile (inductor runs {cxx!r}, from "
                            "$CXX or the default, and it is not on PATH): install g++ or set CXX, or "
                            "train.compile=false")


def validate_for_launch(cfg: RunConfig, world_size: int, local_world_size: int, planner=None) -> Layout:
    """The run's layout on `world_size` ranks (`local_world_size` per node), once every check has
    passed: the degrees and where their groups land (layout.Layout: `shardtune plan` and `launch` build
    the same), what tp and cp split of the model, model states against memory (`planner`:
    `shardtune.plan.plan`, passed by the commands; None: not checked), data, run folder, resume."""
    par = cfg.parallel
    layout = Layout.of_config(par, world_size, local_world_size)
    check_environment(par.strategy, optimizer=cfg.optim.name, quantize_base=cfg.lora.quantize_base,
                      compile=cfg.train.compile)
    from shardtune.config.paths import check_recipe_paths  # pydantic stays out of CLI start-up

    check_recipe_paths(cfg, "model.")
    _check_model(cfg.model, cfg.train.seq_len)
    layout.check_model(resolve_model_config(cfg.model.name), cfg.train.seq_len, trains=True, compile=cfg.train.compile)
    check_pipeline(cfg)  # what the trainer's pipeline runs with (rules/pipeline.py)
    check_pipeline_model(par.pp, par.pp_layers, resolve_model_config(cfg.model.name))  # what pp splits
    gpus = _check_backend(cfg.train.backend, local_world_size)
    _check_model_states_fit(cfg, world_size, local_world_size, gpus, planner)
    check_recipe_paths(cfg)
    if cfg.lora.rank > 0:
        _check_lora_targets(cfg)
    if cfg.train.objective == "grpo":  # prompts read and rendered as the ranks will; the reward files
        from shardtune.train.core.rewards import check_reward_file
        from shardtune.train.data.prompts import check_prompt_data

        for r in cfg.rl.reward:
            if ":" in r.name:
                check_reward_file(r.name, cfg.model.name, cfg.data.path)
        check_prompt_data(cfg, layout.dp)
    elif cfg.train.objective != "sft":  # pairs: read, tokenised and packed as the ranks will (train/data/preference.py)
        from shardtune.train.data.preference import check_preference_data

        check_preference_data(cfg, world_size)
    else:
        check_dataset(cfg.data)
        _check_data_fills_a_batch(cfg, layout.dp)  # the ranks of one TP group read the same rows
        if cfg.data.has_val:
            _check_val(cfg)
    _check_writable(cfg.run_dir)
    resolve_resume(cfg.checkpoint, cfg.run_dir)  # a --resume PATH must be a complete checkpoint
    return layout
