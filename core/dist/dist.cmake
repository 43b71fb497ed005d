# core/dist: the distributed runtime on PyTorch's c10d (TCPStore, ProcessGroupGloo, ProcessGroupNCCL).
# Its sources are part of hydrahead-core (the glob above); this file decides whether the NCCL backend
# is compiled in and writes hydrahead/dist_config.h. The c10d headers ship with LibTorch; Gloo's come
# with it too (pip torch) or from Debian's libgloo-dev (scripts/common.sh installs it).
#
# NCCL needs a CUDA LibTorch whose c10d has ProcessGroupNCCL (its header compiles only with
# USE_C10D_NCCL, which LibTorch does not export to consumers) and nccl.h (the CUDA toolkit or pip's
# nvidia-nccl wheel). When all three are found, process_group.cpp defines USE_C10D_NCCL itself.
option(HH_WITH_NCCL "Compile c10d's NCCL backend in when LibTorch has it" ON)
set(HH_HAVE_NCCL 0)
set(HH_HAVE_GLOO 0)
find_path(HH_GLOO_INCLUDE_DIR gloo/algorithm.h HINTS ${TORCH_INCLUDE_DIRS})
if(HH_GLOO_INCLUDE_DIR)
  set(HH_HAVE_GLOO 1)
endif()
if(HH_WITH_NCCL AND TORCH_CUDA_LIBRARIES)
  find_file(HH_C10D_NCCL_HEADER torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp HINTS ${TORCH_INCLUDE_DIRS} NO_CACHE)
  get_filename_component(_hh_torch_site "${TORCH_INSTALL_PREFIX}/.." ABSOLUTE)
  find_path(HH_NCCL_INCLUDE_DIR nccl.h
    HINTS ${_hh_torch_site}/nvidia/nccl/include ${_hh_torch_site}/nvidia/cu13/include ${_hh_torch_site}/nvidia/cu12/include
          ${CUDAToolkit_INCLUDE_DIRS} ${CUDA_INCLUDE_DIRS} /usr/local/cuda/include /usr/include)
  if(HH_C10D_NCCL_HEADER AND HH_NCCL_INCLUDE_DIR)
    set(HH_HAVE_NCCL 1)
    target_include_directories(hydrahead-core PUBLIC ${HH_NCCL_INCLUDE_DIR})
  endif()
endif()
# pip torch's LibTorch ships no Gloo headers: such a build has NCCL (GPU ranks) only.
if(NOT HH_HAVE_GLOO AND NOT HH_HAVE_NCCL)
  message(FATAL_ERROR "Gloo headers (gloo/algorithm.h) not found and no NCCL backend: install libgloo-dev (Debian)")
endif()
configure_file(${CMAKE_CURRENT_LIST_DIR}/dist_config.h.in ${PROJECT_BINARY_DIR}/generated/hydrahead/dist_config.h @ONLY)
message(STATUS "HydraHead: distributed backends Gloo ${HH_HAVE_GLOO}, NCCL ${HH_HAVE_NCCL}")
