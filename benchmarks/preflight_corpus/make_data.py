"""Small synthetic data sets and model folders for the public-script corpus (issue 50 item 5).

The corpus's scripts (``manifest.json``) run unmodified, with no network: what they would download is made
here instead, deterministically (seeded), on the CPU, in a few seconds to a minute:

- ``text``: English-like text (pseudo-words, Zipf-distributed, lines and paragraphs): ``input.txt`` (minGPT's
  chargpt, the ng-video-lecture GPT), ``wikitext-2/{train,valid,test}.txt`` (pytorch/examples'
  word_language_model), ``wikitext-2.txt`` (Lightning's ``WikiText2`` demo), ``train.txt`` (run_clm).
- ``tokenizer``: a byte-level BPE tokenizer trained on that text (``tokenizers``), saved as a transformers
  ``PreTrainedTokenizerFast`` folder (bos/eos ``<|endoftext|>``, pad ``<pad>``, 2,048 tokens long).
- ``llama``: a randomly initialised Llama causal LM (``LlamaConfig``, 768 wide, 6 layers, ~55 M parameters)
  saved with that tokenizer: the ``--base_model`` of the PEFT scripts.
- ``sft``: ``train.jsonl`` / ``test.jsonl`` / ``validation.jsonl`` with ``text``, ``instruction`` and ``output`` fields (the PEFT
  scripts' ``load_dataset(data_path)``; LoRA-GA's ``load_dataset(name, "default")`` needs ``validation``).
- ``mnist``: ``MNIST/raw/*-ubyte`` in the IDX format torchvision's ``MNIST`` reads (random digits-like blobs,
  6,000 train / 1,000 test): torchvision skips the download when the raw files exist.
- ``images``: an ImageFolder (``train/``, ``val/`` and ``validation/``, 10 classes, JPEG 96 x 96) and ``pets/``
  (``NAME_N.jpg``, the Oxford-pets naming accelerate's cv examples parse the label from).
- ``hub``: a Hugging Face hub cache (``hf_home/hub``) holding ``timm/resnet50d.ra2_in1k`` (random weights,
  ``model.safetensors``): what ``timm.create_model("resnet50d", pretrained=True)`` reads with
  ``HF_HUB_OFFLINE=1``.
- ``nanogpt``: nanoGPT's ``data/<dataset>/`` memmaps (uint16 token ids): ``openwebtext/{train,val}.bin`` (Zipf over
  GPT-2's 50,257 ids) and ``shakespeare_char/{train,val}.bin`` with its ``meta.pkl`` (65 characters).
- ``torch_home``: a ``TORCH_HOME`` whose ``hub/checkpoints`` holds what torchvision's ``weights=`` / ``pretrained=True``
  reads instead of downloading (the file exists: no download, no hash check): ``vgg16-397923af.pth`` (random
  ``features``; the unused ``classifier`` as zero-stride zeros, 59 MB) and ``resnet50-0676ba61.pth`` (random).

    python benchmarks/preflight_corpus/make_data.py DATA_DIR [--only NAME ...]

Everything is made under DATA_DIR; a set already made (its ``.done`` marker) is kept.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import time
from pathlib import Path

SEED = 50


def _rng(salt: int):
    import numpy as np

    return np.random.default_rng(SEED * 1000 + salt)


def _done(path: Path) -> bool:
    return (path / ".done").exists()


def _mark(path: Path) -> None:
    (path / ".done").write_text(time.strftime("%Y-%m-%dT%H:%M:%S") + "\n")


def _words(n_vocab: int = 4000):
    r = _rng(1)
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    p = 1.0 / (1 + r.permutation(26).astype(float) * 0.35)  # a fixed, skewed letter distribution
    p /= p.sum()
    words = set()
    while len(words) < n_vocab:
        k = int(r.integers(1, 11))
        words.add("".join(r.choice(list(letters), size=k, p=p)))
    return sorted(words)


def make_text(out: Path, n_words: int = 260_000) -> None:
    """``n_words`` pseudo-words, Zipf-distributed, in sentences, lines and paragraphs (about 1.5 MB)."""
    out.mkdir(parents=True, exist_ok=True)
    r = _rng(2)
    vocab = _words()
    ranks = r.zipf(1.2, size=n_words) % len(vocab)
    lines, line, sentence = [], [], 0
    for i, k in enumerate(ranks):
        w = vocab[int(k)]
        if sentence == 0:
            w = w.capitalize()
        line.append(w)
        sentence += 1
        if sentence > int(r.integers(6, 18)):
            line[-1] += "."
            sentence = 0
            if len(line) > 12 and r.random() < 0.5:
                lines.append(" ".join(line))
                line = []
                if r.random() < 0.15:
                    lines.append("")
    lines.append(" ".join(line))
    text = "\n".join(lines) + "\n"
    (out / "input.txt").write_text(text)
    (out / "train.txt").write_text(text)
    (out / "wikitext-2.txt").write_text(text)
    wt = out / "wikitext-2"
    wt.mkdir(exist_ok=True)
    n = len(lines)
    (wt / "train.txt").write_text("\n".join(lines[: int(n * 0.8)]) + "\n")
    (wt / "valid.txt").write_text("\n".join(lines[int(n * 0.8): int(n * 0.9)]) + "\n")
    (wt / "test.txt").write_text("\n".join(lines[int(n * 0.9):]) + "\n")


def make_tokenizer(out: Path, text: Path, vocab_size: int = 8192) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([str(text / "input.txt")], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   unk_token="<|endoftext|>", pad_token="<pad>", model_max_length=2048)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))


def make_llama(out: Path, tokenizer: Path) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(tokenizer))
    torch.manual_seed(SEED)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=768, intermediate_size=2048, num_hidden_layers=6,
                      num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=2048,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))


def make_sft(out: Path, n_train: int = 2000, n_test: int = 200) -> None:
    out.mkdir(parents=True, exist_ok=True)
    r = _rng(3)
    vocab = _words()

    def phrase(lo: int, hi: int) -> str:
        return " ".join(vocab[int(k) % len(vocab)] for k in r.zipf(1.2, size=int(r.integers(lo, hi))))

    for name, n in (("train", n_train), ("test", n_test), ("validation", n_test)):
        with open(out / f"{name}.jsonl", "w") as f:
            for _ in range(n):
                ins, outp = phrase(8, 40), phrase(20, 160)
                f.write(json.dumps({"instruction": ins, "input": "", "output": outp,
                                    "text": f"### Instruction:\n{ins}\n### Response:\n{outp}"}) + "\n")


def _idx(path: Path, arr, kind: int) -> None:
    """IDX file (the MNIST format): magic ``0x0000 0x08 ndim``, big-endian sizes, then uint8 data."""
    with open(path, "wb") as f:
        f.write(struct.pack(">HBB", 0, 0x08, arr.ndim))
        for d in arr.shape:
            f.write(struct.pack(">I", d))
        f.write(arr.astype("uint8").tobytes())


def make_mnist(out: Path, n_train: int = 6000, n_test: int = 1000) -> None:
    import numpy as np

    raw = out / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    r = _rng(4)
    yy, xx = np.mgrid[0:28, 0:28]
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        labels = r.integers(0, 10, size=n)
        cy, cx = 8 + labels * 1.2, 20 - labels * 1.2  # a blob whose place depends on the label
        img = np.exp(-(((yy[None] - cy[:, None, None]) ** 2 + (xx[None] - cx[:, None, None]) ** 2) / 18.0))
        img = np.clip(img * 255 + r.normal(0, 20, size=img.shape), 0, 255)
        _idx(raw / f"{prefix}-images-idx3-ubyte", img, 3)
        _idx(raw / f"{prefix}-labels-idx1-ubyte", labels, 1)


def make_images(out: Path, classes: int = 10, n_train: int = 32, n_val: int = 4, size: int = 96) -> None:
    from PIL import Image

    r = _rng(5)
    for split, n in (("train", n_train), ("val", n_val), ("validation", n_val)):
        for c in range(classes):
            d = out / split / f"class_{c:02d}"
            d.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                base = r.integers(0, 255, size=(3,))
                img = (base[None, None, :] + r.normal(0, 40, size=(size, size, 3))).clip(0, 255).astype("uint8")
                Image.fromarray(img).save(d / f"img_{i:03d}.jpg", quality=85)
    pets = out / "pets"
    pets.mkdir(parents=True, exist_ok=True)
    for c in range(classes):
        for i in range(n_train):
            img = r.integers(0, 255, size=(size, size, 3)).astype("uint8")
            Image.fromarray(img).save(pets / f"breed{c:02d}_{i}.jpg", quality=85)


def make_hub(out: Path) -> None:
    """``timm/resnet50d.ra2_in1k`` in a hub cache (``out`` is ``HF_HOME``): refs/main and one snapshot."""
    import timm
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(SEED)
    model = timm.create_model("resnet50d", pretrained=False)
    repo = out / "hub" / "models--timm--resnet50d.ra2_in1k"
    commit = "0" * 39 + "1"
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(snap / "model.safetensors"))
    (snap / "config.json").write_text(json.dumps({"architecture": "resnet50d", "num_classes": 1000,
                                                  "pretrained_cfg": {"tag": "ra2_in1k"}}))


def make_nanogpt(out: Path) -> None:
    import pickle

    import numpy as np

    r = _rng(6)
    owt = out / "openwebtext"
    owt.mkdir(parents=True, exist_ok=True)
    for name, n in (("train", 2_000_000), ("val", 200_000)):
        (r.zipf(1.3, size=n) % 50257).astype(np.uint16).tofile(owt / f"{name}.bin")
    chars = sorted("\n !$&',-.3:;?" + "ABCDEFGHIJKLMNOPQRSTUVWXYZ" + "abcdefghijklmnopqrstuvwxyz")
    sc = out / "shakespeare_char"
    sc.mkdir(parents=True, exist_ok=True)
    p = 1.0 / (1 + r.permutation(len(chars)).astype(float))
    p /= p.sum()
    for name, n in (("train", 1_000_000), ("val", 100_000)):
        r.choice(len(chars), size=n, p=p).astype(np.uint16).tofile(sc / f"{name}.bin")
    with open(sc / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": dict(enumerate(chars)),
                     "stoi": {c: i for i, c in enumerate(chars)}}, f)


def make_torch_home(out: Path) -> None:
    import torch
    import torchvision

    ck = out / "hub" / "checkpoints"
    ck.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    vgg = torchvision.models.vgg16()
    sd = {k: (v.contiguous() if k.startswith("features.") else torch.zeros((), dtype=v.dtype).expand(v.shape))
          for k, v in vgg.state_dict().items()}
    torch.save(sd, str(ck / "vgg16-397923af.pth"))
    torch.save(torchvision.models.resnet50().state_dict(), str(ck / "resnet50-0676ba61.pth"))


SETS = ("text", "tokenizer", "llama", "sft", "mnist", "images", "hub", "nanogpt", "torch_home")


def make(data: Path, only: list[str] | None = None) -> dict[str, float]:
    """Make the sets named (default all, in dependency order) under ``data``; returns seconds per set made."""
    want = [s for s in SETS if not only or s in only]
    if "tokenizer" in want or "llama" in want:
        want = sorted(set(want) | {"text", "tokenizer"}, key=SETS.index)
    took: dict[str, float] = {}
    for name in want:
        path = data / name
        if _done(path):
            continue
        t0 = time.perf_counter()
        path.mkdir(parents=True, exist_ok=True)
        if name == "text":
            make_text(path)
        elif name == "tokenizer":
            make_tokenizer(path, data / "text")
        elif name == "llama":
            make_llama(path, data / "tokenizer")
        elif name == "sft":
            make_sft(path)
        elif name == "mnist":
            make_mnist(path)
        elif name == "images":
            make_images(path)
        elif name == "hub":
            make_hub(path)
        elif name == "nanogpt":
            make_nanogpt(path)
        elif name == "torch_home":
            make_torch_home(path)
        _mark(path)
        took[name] = round(time.perf_counter() - t0, 1)
        print(f"make_data: {name} in {took[name]} s", file=sys.stderr)
    return took


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data", type=Path)
    ap.add_argument("--only", nargs="*", choices=SETS)
    a = ap.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    make(a.data, a.only)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
