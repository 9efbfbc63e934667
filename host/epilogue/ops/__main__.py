from host.epilogue.ops.doc import main

main()
