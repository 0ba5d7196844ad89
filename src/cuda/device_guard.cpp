// The driver's view of a device's primary context, for DeviceGuard
// (device_guard.h). Through the runtime's driver entry points, so that flce
// does not link libcuda (absent where no driver is installed, as in CI).
#include "cuda/device_guard.h"

#include <cudaTypedefs.h>

#include "cuda/driver_entry.h"

namespace flce::cuda {

bool has_primary_context(int device) {
  static const auto get_device =
      reinterpret_cast<PFN_cuDeviceGet_v2000>(driver_entry_point("cuDeviceGet", 2000));
  static const auto get_state = reinterpret_cast<PFN_cuDevicePrimaryCtxGetState_v7000>(
      driver_entry_point("cuDevicePrimaryCtxGetState", 7000));
  if (get_device == nullptr || get_state == nullptr) return true;
  CUdevice handle = 0;
  unsigned flags = 0;
  int active = 0;
  if (get_device(&handle, device) != CUDA_SUCCESS ||
      get_state(handle, &flags, &active) != CUDA_SUCCESS)
    return true;
  return active != 0;
}

}  // namespace flce::cuda
