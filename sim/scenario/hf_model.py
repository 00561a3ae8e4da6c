"""A model from a Hugging Face ``config.json``: the bundled library, and the description cache.

``model.config = "path/to/config.json"`` (relative to the scenario file) or ``model.preset = NAME``
with a name (or hub id) of the bundled library (``sim/scenario/hf_library/index.json``, each
config written from the published one, its source recorded). Nothing reaches a hub: a hub id the
library does not have is one clear error saying where to put the config.

The description is measured on the torch side (``python -m hfmodel describe``, run as a child
process so that this package imports no torch; forked from a server that imported torch and
transformers once, ``sim.childproc``) at the scenario's micro-batch, sequence length and
compute dtype, and cached on disk under ``$FSDPSIM_CACHE_DIR`` (default
``~/.cache/fsdp-sim/models``) keyed by the config's content, those dims, the description version
and the installed transformers: a sweep pays each extraction once.
"""

import hashlib
import json
import os
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from sim.childproc import ChildTimeout, run_module
from sim.errors import UserError
from sim.fileio import read_json, write_json_atomic
from sim.workload.description import DESCRIPTION_VERSION, ModelDescription, finetune_key, parse_description
from sim.workload.model import ModelConfig

LIBRARY = Path(__file__).resolve().parent / "hf_library"
EXTRACT_TIMEOUT_S = 1800.0


@dataclass(frozen=True, kw_only=True)
class LibraryEntry:
    name: str
    hub_id: str
    family: str
    source: str
    path: Path


def library() -> dict[str, LibraryEntry]:
    """The bundled configs by short name (``index.json``: name -> hub id, family, source, file)."""
    index = read_json(LIBRARY / "index.json", "model library index")
    return {
        name: LibraryEntry(
            name=name, hub_id=e["hub_id"], family=e["family"], source=e["source"], path=LIBRARY / e["file"]
        )
        for name, e in index.items()
    }


def library_entry(name: str, where: str) -> LibraryEntry | None:
    """The entry named ``name`` (short name or hub id); None when ``name`` is neither; a hub id the
    library lacks is a UserError saying where its config goes."""
    entries = library()
    if name in entries:
        return entries[name]
    by_hub = {e.hub_id.lower(): e for e in entries.values()}
    if name.lower() in by_hub:
        return by_hub[name.lower()]
    if "/" in name:
        raise UserError(
            f"{where}: model.preset {name!r} is not in the bundled model library and nothing here downloads "
            f"from the Hugging Face hub: save its config.json (huggingface.co/{name}/blob/main/config.json) "
            'next to the scenario and set model.config = "config.json" (`fsdpsim presets` lists the library)'
        )
    return None


def read_config(path: Path, where: str) -> dict[str, Any]:
    if not path.is_file():
        raise UserError(f"{where}: model.config: {path} not found")
    data = read_json(path, "config.json")
    if not isinstance(data, dict) or "model_type" not in data:
        raise UserError(f"{where}: model.config: {path} is not a Hugging Face config.json (no model_type)")
    return data


def config_sha256(config: dict[str, Any]) -> str:
    """The content key of a config (the torch side computes the same, ``hfmodel.describe``)."""
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()


def cache_dir() -> Path:
    return Path(os.environ.get("FSDPSIM_CACHE_DIR") or Path.home() / ".cache" / "fsdp-sim" / "models")


def _transformers_version(where: str) -> str:
    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        raise UserError(
            f"{where}: a model from a config.json is measured with transformers: pip install -e '.[torch]'"
        ) from None


def llama_config_file(model: ModelConfig) -> Path:
    """A hand-written Llama preset as the ``LlamaConfig`` of its dimensions (as
    ``calibrate.hf_llama.llama_config`` builds it), written once into the cache folder, so that
    the real model can be measured with PEFT's adapters."""
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": model.hidden,
        "intermediate_size": model.ffn_hidden,
        "num_hidden_layers": model.n_layers,
        "num_attention_heads": model.n_heads,
        "num_key_value_heads": model.n_kv_heads,
        "vocab_size": model.vocab,
        "tie_word_embeddings": model.tie_embeddings,
    }
    path = cache_dir() / "configs" / f"{model.name.rstrip('*')}-{config_sha256(config)[:16]}.config.json"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, config)
    return path


def _extract(
    config_path: Path,
    out: Path,
    *,
    name: str,
    micro_batch: int,
    seq_len: int,
    dtype: str,
    where: str,
    finetune: dict[str, Any] | None,
    decoder_seq_len: int | None,
) -> None:
    root = Path(__file__).resolve().parent.parent.parent
    args = ["describe", str(config_path), "--name", name]
    args += [
        "--micro-batch",
        str(micro_batch),
        "--seq-len",
        str(seq_len),
        "--dtype",
        dtype,
        "--out",
        str(out),
    ]
    if finetune is not None:
        args += ["--finetune", json.dumps(finetune, sort_keys=True)]
    if decoder_seq_len is not None:
        args += ["--decoder-seq-len", str(decoder_seq_len)]
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    )
    try:  # a child of a forkserver that imported torch and transformers once (sim.childproc)
        proc = run_module(
            "hfmodel",
            args,
            env=env,
            cwd=os.getcwd(),
            timeout_s=EXTRACT_TIMEOUT_S,
            # PEFT (1.5-4 s, bitsandbytes with it) is the fine-tuned children's own import: the
            # server takes it once, so that in a sweep only the first point's description pays
            preload=("hfmodel.describe", *(("peft",) if finetune is not None else ())),
        )
    except ChildTimeout:
        raise UserError(
            f"{where}: measuring {config_path} timed out after {EXTRACT_TIMEOUT_S:.0f} s"
        ) from None
    if proc.returncode != 0 or not out.is_file():
        lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
        raise UserError(f"{where}: measuring {config_path} failed: {lines[-1] if lines else proc.returncode}")


def describe_config(
    config_path: Path,
    *,
    name: str,
    micro_batch: int,
    seq_len: int,
    dtype: str,
    where: str,
    finetune: dict[str, Any] | None = None,
    decoder_seq_len: int | None = None,
) -> ModelDescription:
    """The description of ``config_path`` at these dims (and fine-tuning settings, measured with
    PEFT; an encoder-decoder's decoder length, ``seq_len`` when None): from the cache, else
    measured and cached."""
    config = read_config(config_path, where)
    sha = config_sha256(config)
    version = _transformers_version(where)
    tune = finetune_key(finetune)
    if decoder_seq_len == seq_len:
        decoder_seq_len = None  # the default: one measurement
    decoder = "" if decoder_seq_len is None else f"-d{decoder_seq_len}"
    cached = (
        cache_dir()
        / f"{name}-{sha[:16]}-mb{micro_batch}-s{seq_len}{decoder}-{dtype}-{tune}-v{DESCRIPTION_VERSION}-tf{version}.json"
    )
    if not cached.is_file():
        _extract(
            config_path,
            cached,
            name=name,
            micro_batch=micro_batch,
            seq_len=seq_len,
            dtype=dtype,
            where=where,
            finetune=finetune,
            decoder_seq_len=decoder_seq_len,
        )
    description = parse_description(read_json(cached, "model description"), str(cached))
    if description.config_sha256 != sha:
        raise UserError(f"{cached}: describes another config than {config_path}; delete it")
    return description
