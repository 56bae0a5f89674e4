"""Dense heads on frozen image towers: DPT decoders for depth, normals and segmentation (docs/dense-heads.md)."""
