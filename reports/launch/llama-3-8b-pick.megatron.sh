#!/bin/bash
# Written by mpsim for llama-3-8b on 1 x dgx-h100, 8 GPUs.
# mpsim job: {"model":"llama-3-8b","server":"dgx-h100","seq_len":8192,"recipe":"mixed-bf16","microbatch":1,"microbatches":2,"data":8,"zero_stage":3}
# predicted: fits, peak 69.12 GiB per GPU, iteration 1.661 s, 9.63 samples/s, runtime profile megatron-lm
torchrun --nproc-per-node 8 pretrain_gpt.py \
  --tensor-model-parallel-size 1 \
  --pipeline-model-parallel-size 1 \
  --use-torch-fsdp2 \
  --micro-batch-size 1 \
  --global-batch-size 16 \
  --seq-length 8192 \
  --bf16 \
  --grad-reduce-in-bf16 \
  --overlap-grad-reduce \
  --ddp-bucket-size 13107200 \
  --num-layers 32 \
  --hidden-size 4096 \
  --num-attention-heads 32 \
  --ffn-hidden-size 14336 \
  --max-position-embeddings 8192 \
  --use-flash-attn \
  --group-query-attention \
  --num-query-groups 8 \
  --swiglu \
  --normalization RMSNorm \
  --position-embedding-type rope \
  --untie-embeddings-and-output-weights \
  --disable-bias-linear
