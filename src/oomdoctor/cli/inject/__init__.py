"""The directory ``oomdoctor run`` puts first on ``PYTHONPATH``; it holds only ``sitecustomize``."""
