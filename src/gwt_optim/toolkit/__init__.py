"""The training harness: pre-train and fine-tune LLaMA-style models with GWT and
its peers, and compare quality, memory and speed side by side.

Needs the ``train`` extra (``pip install 'gwt-optim[train,peers,demo]'``).
"""
