"""Scale-out on existing engines: tensor parallel under torchrun (``acb.distributed.tp``)."""
