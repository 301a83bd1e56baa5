# GLM-4-9B LoRA: one process, the model split over four 24 GB cards
export CUDA_VISIBLE_DEVICES=0,1,2,3
python finetune_glm.py \
    --model_name_or_path THUDM/glm-4-9b-chat \
    --use_lora True \
    --lora_r 8 \
    --bf16 True \
    --per_device_train_batch_size 1 \
    --gradient_accumulation_steps 16 \
    --max_seq_length 8192 \
    --gradient_checkpointing True \
    --output_dir output/glm4
