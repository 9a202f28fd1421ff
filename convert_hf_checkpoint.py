"""Converts a Hugging Face Qwen3 snapshot into qwen3-fast weights (fused qkv_proj and gate_up_proj, safetensors).

    python convert_hf_checkpoint.py --checkpoint-dir checkpoints/Qwen/Qwen3-0.6B          # writes .../converted
    python convert_hf_checkpoint.py --repo Qwen/Qwen3-0.6B                                # downloads it first
    python convert_hf_checkpoint.py --checkpoint-dir checkpoints/Qwen/Qwen3-8B --int8     # writes .../converted-int8

Tensors are read one at a time and written in shards, so memory stays near one shard however large the model is.
"""
import argparse, dataclasses, glob, json, os, pathlib, shutil, sys, tempfile
from collections import Counter

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from model import ModelArgs, Transformer, UserError, quantize_int8

FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
         "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
N_PARTS = Counter(fused for fused, _ in FUSED.values())
COPIED = ["tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
          "generation_config.json"]


def map_name(hf_name: str) -> tuple[str, int]:
    """A Hugging Face tensor name -> (our name, its index among the parts of a fused tensor)."""
    parts = hf_name.removeprefix("model.").split(".")
    if len(parts) > 1:
        parts[-2], index = FUSED.get(parts[-2], (parts[-2], 0))
        return ".".join(parts), index
    return hf_name, 0


def read_tensor(file: str, name: str) -> torch.Tensor:
    try:
        with safe_open(file, "pt") as f:  # opened per tensor: only this tensor's pages are ever mapped
            return f.get_tensor(name)
    except Exception as e:
        raise UserError(f"{file}: cannot read tensor {name} ({e}); the file is truncated or corrupt, download it again")


def list_tensors(src: str) -> dict[str, str]:
    files = sorted(glob.glob(os.path.join(src, "*.safetensors")))
    if not files:
        bins = glob.glob(os.path.join(src, "*.bin")) + glob.glob(os.path.join(src, "*.pt*"))
        raise UserError(f"{src}: only .bin/.pt weights found; safetensors only, download the safetensors files"
                        if bins else f"{src}: no *.safetensors weights found")
    index = os.path.join(src, "model.safetensors.index.json")
    if os.path.isfile(index):
        missing = set(json.loads(pathlib.Path(index).read_text())["weight_map"].values()) - {
            os.path.basename(p) for p in files}
        if missing:
            raise UserError(f"{src}: shard {sorted(missing)[0]} named in the index is missing; download it")
    tensors = {}
    for file in files:
        try:
            with safe_open(file, "pt") as f:
                tensors.update((name, file) for name in f.keys())
        except Exception as e:
            raise UserError(f"{file}: not a readable safetensors file ({e}); download it again")
    return tensors


def convert(src: str, out: str, int8: bool = False, shard_bytes: int = 2 << 30) -> None:
    if not os.path.isfile(os.path.join(src, "config.json")):
        raise UserError(f"{src}: no config.json; point --checkpoint-dir at a Hugging Face Qwen3 snapshot")
    cfg = json.loads(pathlib.Path(src, "config.json").read_text())
    if "quantization_config" in cfg:
        raise UserError(f"{src}: quantized Hugging Face checkpoints are not supported; use the bf16 one")
    ours = "quantization" in cfg  # a directory this script wrote: already fused, may be re-converted to int8
    args = ModelArgs.from_config(cfg)
    if int8 and args.quantization:
        raise UserError(f"{src}: already quantized to {args.quantization}; convert the original checkpoint instead")
    if ours and not int8:
        raise UserError(f"{src}: already converted; add --int8 to quantize it, or point at the Hugging Face snapshot")
    args.quantization = "int8" if int8 else args.quantization
    with torch.device("meta"):
        expected = Transformer(args).state_dict()
    if args.tie_word_embeddings:
        del expected["lm_head.weight"]  # the embedding serves as lm_head
    sources: dict[str, dict[int, tuple[str, str]]] = {}
    for hf_name, file in list_tensors(src).items():
        name, part = (hf_name, 0) if ours else map_name(hf_name)
        if name == "lm_head.weight" and args.tie_word_embeddings:
            continue
        if name not in expected:
            raise UserError(f"{file}: tensor {hf_name} has no place in a Qwen3 model")
        sources.setdefault(name, {})[part] = (file, hf_name)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".converting-", dir=os.path.dirname(os.path.abspath(out)))
    try:
        shard, size, n_shards = {}, 0, 0
        for name, meta in expected.items():
            if name.endswith(".scale") and name.removesuffix(".scale") + ".weight" in expected:
                continue  # written with its weight
            n_parts = 1 if ours else N_PARTS.get(name.split(".")[-2], 1)
            parts = sources.get(name, {})
            if sorted(parts) != list(range(n_parts)):
                raise UserError(f"{src}: the checkpoint lacks {name} (or one of the tensors fused into it)")
            w = torch.cat([read_tensor(*parts[i]) for i in range(n_parts)])
            if w.shape != meta.shape:
                raise UserError(f"{src}: {name} has shape {tuple(w.shape)}, config.json implies {tuple(meta.shape)}")
            scale_name = name.removesuffix(".weight") + ".scale"
            if scale_name in expected:  # int8 inputs never get here: they are refused above
                w, shard[scale_name] = quantize_int8(w)
            shard[name] = w.contiguous()
            size += w.numel() * w.element_size()
            if size >= shard_bytes:
                save_file(shard, os.path.join(tmp, f"model-{n_shards:05d}.safetensors"))
                shard, size, n_shards = {}, 0, n_shards + 1
        if shard:
            save_file(shard, os.path.join(tmp, f"model-{n_shards:05d}.safetensors"))
        pathlib.Path(tmp, "config.json").write_text(json.dumps(dataclasses.asdict(args), indent=2))
        for name in COPIED:
            if os.path.isfile(os.path.join(src, name)):
                shutil.copy(os.path.join(src, name), tmp)
        shutil.rmtree(out, ignore_errors=True)  # swap in the new directory only once it is complete
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint-dir", help="a Hugging Face Qwen3 snapshot (config.json + *.safetensors)")
    ap.add_argument("--repo", help="download this Hugging Face repo first, e.g. Qwen/Qwen3-0.6B (huggingface_hub)")
    ap.add_argument("--output", help="where to write (default: CHECKPOINT_DIR/converted, or converted-int8)")
    ap.add_argument("--int8", action="store_true", help="int8 weight-only quantization (blocks, untied lm_head)")
    ap.add_argument("--shard-size-mb", type=int, default=2048, help="size of each output file")
    a = ap.parse_args(argv)
    try:
        if a.repo:
            try:
                from huggingface_hub import snapshot_download
            except ImportError:
                raise UserError("--repo needs huggingface_hub: pip install huggingface_hub")
            local_dir = a.checkpoint_dir or os.path.join("checkpoints", a.repo)
            a.checkpoint_dir = snapshot_download(a.repo, local_dir=local_dir, allow_patterns=[
                "*.json", "*.safetensors", "*.txt", "tokenizer.model"])
        if not a.checkpoint_dir:
            raise UserError("give --checkpoint-dir DIR (a Hugging Face Qwen3 snapshot) or --repo Qwen/Qwen3-0.6B")
        out = a.output or os.path.join(a.checkpoint_dir, "converted-int8" if a.int8 else "converted")
        convert(a.checkpoint_dir, out, a.int8, a.shard_size_mb << 20)
    except UserError as e:
        sys.exit(f"error: {e}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
