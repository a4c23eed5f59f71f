"""What the library reads of other libraries, on the ground floor: any module of the library may import it.

* :mod:`.versions`: the transformers releases the library runs on (the floor, checked at ``import hf_neural_attn``).
* :mod:`.internals`: every private name of transformers, torch, accelerate and DeepSpeed the library reads or
  writes outside ``integrations/``, behind one accessor each.
* :mod:`.tensors`: torch's distributed tensor type (DTensor), recognised without importing it.

Nothing here changes another library; what the library changes in them is ``hf_neural_attn/integrations/``'s table.
The two folders are the integrations room: ``tests/architecture/test_architecture.py`` checks that no module outside
them reads another library's private names, and that none outside ``integrations/`` changes another library. This
file imports nothing, so that importing a module of the folder loads that module alone.
"""
