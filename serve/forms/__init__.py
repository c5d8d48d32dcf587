"""Choosing the form a full fine-tune is stored and served in (`manyfold store add --kind auto`).

lowrank.py cuts a fine-tune's delta to rank r (a LoRA the store serves as kind "lora"); emr_member.py re-merges an
EMR group with the fine-tune as one more task; agreement.py measures a candidate against the fine-tune on a
calibration set; auto.py lays the candidates out by resident bytes and registers the cheapest within tolerance.
"""
