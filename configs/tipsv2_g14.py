"""TIPSv2 stage 1 (TIPSv2 §4 "Implementation details"): ViT-g/14, 1 global crop 224 + 6 local crops 98,
mask ratio 0.75 (iBOT++), head-only EMA, L = L_CLIP + 1.0 L_DINO + 2.0 L_iBOT++, multi-granularity
captions (CLS1 <- web alt-text, CLS2 <- PaliGemma/Gemini caption), Adafactor, 90k steps at batch 8192,
bf16 activations / fp32 params, remat per block, scanned blocks. 512 TPU v5 chips, data parallel (see
the mesh in tipsito/config/paper.py for why not FSDP).

Args: variant (g/14 | So400m/14 | L/14 | B/14 | S/14), ema (head | full), steps, batch.
"""
from tipsito.config import args
from tipsito.config import paper


def get_config(arg=None):
  """Stage-1 TIPSv2 config; `variant=B/14` gives the paper's ViT-B ablation size."""
  a = args.parse_arg(arg, variant="g/14", ema="head", steps=90000, batch=8192)
  return paper.tipsv2(a.variant, ema=a.ema, total_steps=a.steps, batch_size=a.batch)
