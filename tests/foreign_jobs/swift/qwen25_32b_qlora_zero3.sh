NPROC_PER_NODE=4 CUDA_VISIBLE_DEVICES=0,1,2,3 swift sft \
    --model Qwen/Qwen2.5-32B-Instruct \
    --train_type lora \
    --quant_bits 4 --quant_method bnb --bnb_4bit_compute_dtype bfloat16 \
    --dataset AI-ModelScope/alpaca-gpt4-data-en \
    --per_device_train_batch_size 1 \
    --max_length 4096 \
    --deepspeed zero3 \
    --output_dir output/qwen32b-qlora
