"""The corpus owner's toolkit: its own secret key, its own watermarked corpus, its own tests.

A corpus owner runs these steps on its own machine with its own key file; the server of a
federated run never needs the key (``fedattr owner ...`` commands):

- :mod:`~fedattr.watermarks.keys`: ``keygen`` writes a secret key file (256 bits from the OS
  CSPRNG, mode 0600, with the scheme and its parameters) and every command checks it;
- :mod:`~fedattr.owner.corpus`: ``watermark`` rewrites a corpus under the key (KGW) or writes
  documents about the key's fabricated entity (Fictitious Knowledge), resumably;
- :mod:`~fedattr.owner.check`: ``check`` tests texts (the watermarked corpus, a leaked
  document) for the key: green count, z and an exact p-value per document and in all;
- :mod:`~fedattr.owner.detect`: ``detect`` tests any released model for the key (the paper's
  global-model test as a standalone tool), with a key-randomisation p-value.
"""
