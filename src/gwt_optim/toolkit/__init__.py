"""The training harness: pre-train and fine-tune LLaMA-style models with GWT and
its peers, and compare quality, memory and speed side by side.

Needs the ``train`` extra (from a checkout: ``pip install -e '.[train,peers,demo]'``).
Importing it quiets the log lines that transformers' and peft's own imports
print (:mod:`gwt_optim.toolkit.quiet`).
"""

from gwt_optim.toolkit.quiet import quiet_third_party

quiet_third_party()
