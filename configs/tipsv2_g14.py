"""TIPSv2 stage 1 (TIPSv2 §4 "Implementation details"): ViT-g/14, 1 global crop 224 + 6 local crops 98,
mask ratio 0.75 (iBOT++), head-only EMA, L = L_CLIP + 1.0 L_DINO + 2.0 L_iBOT++, multi-granularity
captions (CLS1 <- web alt-text, CLS2 <- PaliGemma/Gemini caption), Adafactor, 90k steps at batch 8192,
bf16 activations / fp32 params, remat per block, scanned blocks. 512 TPU v5 chips, data parallel (see
the mesh in tipsito/config/paper.py for why not FSDP).

Global view (`input.global_crop_scale=(1.0, 1.0)`): the whole image, resized to 224 px and flipped with
p = 0.5; it is what the teacher and both CLIP terms see (the student's masked view is the same image).
TIPSv2 §3.1: "the teacher network f_t processes the original image I, and the student network f_s
processes a crop or masked view", with "f^g(I)=e^g the global embedding representation of the entire
image" the embedding L_CLIP aligns with the caption; TIPSv2 §4: "We use only random resizes, crops and
flips as augmentations" (the crops being the 6 local crops, the resize the global view's). §4 also calls
the global view "1 global crop at resolution 224", but names no crop range; the DINOv2 range 0.32-1.0
(tipsito's earlier default, an inference) makes the "original image" a random third to all of it. The
ablation alternative is one override: `--config.input.global_crop_scale='(0.32, 1.0)'`. With the aspect
range `input.crop_ratio` (3/4, 4/3), an image within that range is resized whole (squashed to a square);
a wider or taller one loses its sides to torchvision's fallback centre crop at the range's limit.

Args: variant (g/14 | So400m/14 | L/14 | B/14 | S/14), ema (head | full), steps, batch.
"""

from tipsito.config import args
from tipsito.config import paper


def get_config(arg=None):
  """Stage-1 TIPSv2 config; `variant=B/14` gives the paper's ViT-B ablation size."""
  a = args.parse_arg(arg, variant="g/14", ema="head", steps=90000, batch=8192)
  return paper.tipsv2(a.variant, ema=a.ema, total_steps=a.steps, batch_size=a.batch)
