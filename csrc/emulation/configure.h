// The link between gpucoll's config registry and the emulated device (GPUCOLL_CUDA=emulate builds only):
// gpucoll._C applies the GPUCOLL_EMU_* variables when it is imported, before its first CUDA call.
#pragma once

namespace gpucoll::emulation {

// Sets this process's emulated device shape from the registry. Throws InvalidArgument naming the variable for a
// value the emulator cannot take, InvalidUsage when the device was already used with another shape.
void configure_from_registry();

}  // namespace gpucoll::emulation
