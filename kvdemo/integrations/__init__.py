"""kvdemo inside other tools: lmms-eval (:mod:`kvdemo.integrations.lmms_eval`, needs ``pip install kvdemo[eval]``)
and the offline local tasks it runs on (:mod:`kvdemo.integrations.local_tasks`, no lmms-eval needed to write them)."""
