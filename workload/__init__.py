"""The bundled DFlash trainer and evaluator that run inside training containers.

Never imports the operator's package (`dflashops`): the two share only file formats.
"""
