"""The C kernels and their Python side: instruction-set paths (`isa`), building and loading the
libraries (`cbuild`), block-quantised matmuls (`quant`, quant.c), the fused decode-step glue
(`fused`, fused.c), the sampled token's inverse-CDF draw (`draw`, draw.c) and packed dense
weights (`packed`)."""
