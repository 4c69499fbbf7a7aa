"""The same two networks written twice, once per framework, as a user porting a model writes them.

``mge_resnet`` / ``torch_resnet`` hold ResNet-18 (after MegEngine/Models'
``official/vision/classification/resnet/model.py`` and torchvision's ``resnet.py``) and
``mge_encoder`` / ``torch_encoder`` a BERT-style encoder classifier. Each file keeps its
framework's own conventions, the ones a port has to get right: MegEngine's BatchNorm keeps
``(1, C, 1, 1)`` parameters and a momentum of 0.9 where torch keeps ``(C,)`` and 0.1, MegEngine
writes activations as functions (``F.relu``) where torchvision uses ``nn.ReLU(inplace=True)``
modules, MegEngine's ``x += y`` rebinds the tensor object in place. The parameter-holding
modules carry the same names on both sides, as a port meant to load the other side's
checkpoints does.

``broken`` holds ports with one deliberate bug each (a transposed weight, a missing or wrong
``eps``, a wrong padding), each with the layer a parity check must blame (``broken.PORTS``),
and a BatchNorm momentum copied across conventions, which only the configuration shows.

``paddle_resnet`` / ``paddle_encoder`` are the same two networks in PaddlePaddle (as
``paddle.vision`` and PaddleNLP write them: ``[in, out]`` Linear weights, BatchNorm momentum 0.9,
``epsilon``), and ``paddle_broken`` ten PyTorch -> Paddle ports with one bug each, sorted by kind
(transposed weight, eps, substituted layer, backward-only, config-only, padding, scale);
``tests/test_paddle_ports.py`` checks them against torch by hand and ``bench/bench_padiff.py``
runs PaDiff and the parity tool on them.

Nothing here is imported by gradmgr; ``tests/test_parity_models.py`` runs ``gradmgr.parity`` on
these models. Importing this package imports no framework: import the module you need.
"""
