"""`export`: a trained checkpoint made into a directory that vLLM and SGLang load as it is (the
drafter's files, the chat template it was trained with, a model card with the serving lines),
copied verified to this machine or a target."""
