# two 24 GB cards, plain DDP
CUDA_VISIBLE_DEVICES=0,1 NPROC_PER_NODE=2 swift sft \
    --model Qwen/Qwen2.5-7B-Instruct \
    --train_type lora \
    --dataset data/train.jsonl \
    --torch_dtype bfloat16 \
    --per_device_train_batch_size 1 \
    --gradient_accumulation_steps 16 \
    --max_length 2048 \
    --attn_impl flash_attn \
    --learning_rate 1e-4 \
    --num_train_epochs 1 \
    --use_liger_kernel true \
    --output_dir output/qwen7b
