# Qwen's finetune_qlora_ds.sh, pointed at the ZeRO-3 config
torchrun --nproc_per_node 8 --nnodes 1 finetune.py \
    --model_name_or_path Qwen/Qwen-14B \
    --data_path data/train.json \
    --fp16 True \
    --output_dir output_qwen \
    --num_train_epochs 5 \
    --per_device_train_batch_size 2 \
    --gradient_accumulation_steps 8 \
    --learning_rate 3e-4 \
    --model_max_length 2048 \
    --use_lora \
    --q_lora \
    --gradient_checkpointing \
    --deepspeed ds_config_zero3.json
