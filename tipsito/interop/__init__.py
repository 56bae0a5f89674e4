"""Formats other tools read: what `python -m tipsito.export --format F` writes besides tipsito's own export.

Why a package of its own: tipsito's export format (tipsito/export_format.py) is read by `tipsito.load`;
the formats here belong to someone else; each module holds its writer (and, for the TIPS formats, a strict
reader):
  * `tips_npz.py`   the official TIPS Scenic `.npz` pair (vision + text), the exact inverse of the importer
                    in tipsito/tips_import.py;
  * `hf_tipsv2.py`  a Hugging Face `Tipsv2Model` folder (safetensors in the hub's key layout, config.json,
                    image-processor and tokenizer files), and its reader (`config.init_from`,
                    `distill.teacher`, `export --from`);
  * `clip.py`       CLIP-style models (clip, ito; siglip to open_clip) as a Hugging Face `CLIPModel` folder
                    (`hf_clip`) and an OpenCLIP `local-dir:` checkpoint (`open_clip`).
`sources.py` turns what the export CLI is pointed at (a training workdir and step, a tipsito export, a
Tipsv2 folder) into one in-memory model that every writer takes.
"""
