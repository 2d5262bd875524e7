from django.apps import AppConfig


class HardwareConfig(AppConfig):
    name = "hardware"

    def ready(self) -> None:
        # The one place LLAMA_CPP_LIB_PATH is set: a llama-cpp-python installed without its own
        # libllama (deploy/bootstrap.sh builds llama.cpp once for both engines) loads the cached
        # build's, in every child of this process (backends, the probe, tests' own servers).
        from hardware.backends import export_llama_cpp_lib_path

        export_llama_cpp_lib_path()
