# one process over four 80 GB cards: ms-swift splits the model with device_map
CUDA_VISIBLE_DEVICES=0,1,2,3 \
swift sft \
    --model Qwen/Qwen2.5-72B-Instruct \
    --train_type lora \
    --dataset AI-ModelScope/alpaca-gpt4-data-en \
    --torch_dtype bfloat16 \
    --per_device_train_batch_size 1 \
    --gradient_accumulation_steps 16 \
    --max_length 2048 \
    --output_dir output/qwen72b
