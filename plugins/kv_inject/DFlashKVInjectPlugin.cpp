// TensorRT plugin "DFlashKVInject" (version "1", namespace "dflash_trt"): the fused KV injection of
// dflash_trt/ops/csrc/kv_inject.cu (DFlash paper sec. 3.2) as one layer of a TensorRT 10 engine.
//
// An IPluginV3 with the IPluginV3OneCore / IPluginV3OneBuildV2 / IPluginV3OneRuntime capabilities. Its enqueue
// calls the kernel's C ABI `dflash_kv_inject` with its bindings and stream; nothing else runs on the GPU. Inputs, in
// the order of that ABI (T = float32, float16 or bfloat16, all linear/contiguous):
//
//   0 kv        [n, c, L * 2 * H * D] T       per token, layer l's K (H * D values) then its V
//   1 k_norm    [L, D] T                      each layer's k_norm weight
//   2 cos       [n, c, D] float32             RoPE of each token's position
//   3 sin       [n, c, D] float32
//   4 cache     [2, L, B, H, cap, D] T        the drafter's context cache
//   5 rows      [n] int64                     the cache row of each sequence
//   6 positions [n, c] int64                  the slot (absolute position) of each token, < cap
//
// Output 0 is the updated cache, input 4's shape and dtype. The build capability declares it aliased to input 4
// (getAliasedInput), so with TensorRT's aliased-plugin-I/O preview feature on the write is in place; otherwise
// TensorRT gives the output its own buffer and enqueue first copies the cache into it (cudaMemcpyAsync on the same
// stream) and injects there. One field: eps (kFLOAT32, one value), k_norm's epsilon: the drafter config's
// rms_norm_eps. It has no default, because it differs between models (1e-5, 1e-6) and a wrong one changes K.
//
// TensorRT finds the creator through the two C entry points at the end (`getCreators`, `setLoggerFinder`) that
// IPluginRegistry::loadLibrary / `trtexec --dynamicPlugins` look up; the library does not link libnvinfer
// (REGISTER_TENSORRT_PLUGIN would need its getPluginRegistry). Problems are reported through the execution
// context's error recorder once attached, else the logger TensorRT hands to setLoggerFinder, else stderr.
#include <NvInferRuntime.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>

extern "C" int dflash_kv_inject(int dtype, const void* kv, const void* k_norm, float eps, const float* cos,
                                const float* sin, void* cache, const int64_t* rows, const int64_t* positions, int64_t n,
                                int64_t c, int64_t L, int64_t B, int64_t H, int64_t cap, int64_t D, void* stream);
extern "C" const char* dflash_cuda_error_string(int code);

#define DFLASH_EXPORT __attribute__((visibility("default")))

namespace {

using namespace nvinfer1;

constexpr char const* kNAME = "DFlashKVInject";
constexpr char const* kVERSION = "1";
constexpr char const* kNAMESPACE = "dflash_trt";
enum Input : int32_t { kKV, kKNORM, kCOS, kSIN, kCACHE, kROWS, kPOSITIONS, kNB_INPUTS };
constexpr char const* kINPUT_NAMES[kNB_INPUTS] = {"kv", "k_norm", "cos", "sin", "cache", "rows", "positions"};

std::atomic<ILoggerFinder*> gLoggerFinder{nullptr};

// One message, to `recorder` if there is one, else TensorRT's logger, else stderr; prefixed with the plugin name.
void report(IErrorRecorder* recorder, std::string const& what) noexcept {
  try {
    std::string const msg = std::string(kNAME) + ": " + what;
    if (recorder != nullptr) {
      recorder->reportError(ErrorCode::kINVALID_ARGUMENT, msg.c_str());
      return;
    }
    ILoggerFinder* finder = gLoggerFinder.load();
    ILogger* logger = finder != nullptr ? finder->findLogger() : nullptr;
    if (logger != nullptr)
      logger->log(ILogger::Severity::kERROR, msg.c_str());
    else
      std::fprintf(stderr, "%s\n", msg.c_str());
  } catch (...) {  // std::string allocation: nothing left to report with
  }
}

std::string dims_str(Dims const& d) {
  std::string s = "[";
  for (int32_t i = 0; i < d.nbDims; ++i) s += (i ? ", " : "") + std::to_string(d.d[i]);
  return s + "]";
}

// `dflash_kv_inject`'s dtype code of a TensorRT type, -1 for a type the kernel does not take.
int dtype_code(DataType t) {
  switch (t) {
    case DataType::kFLOAT: return 0;
    case DataType::kHALF: return 1;
    case DataType::kBF16: return 2;
    default: return -1;
  }
}

int64_t volume(Dims const& d) {
  int64_t v = 1;
  for (int32_t i = 0; i < d.nbDims; ++i) v *= d.d[i];
  return v;
}

// The inputs' shapes against each other: "" if they fit (or cannot be judged yet), else what is wrong. A dimension
// below 0 is unknown (a build-time wildcard) and is only checked once known; `exact` (onShapeChange, enqueue)
// requires every dimension, and the kernel's own limits, which a wildcard could still break or meet.
std::string check_shapes(Dims const* in, bool exact) {
  Dims const& cache = in[kCACHE];
  if (cache.nbDims != 6) return "cache must be [2, L, B, H, cap, D], got " + dims_str(cache);
  int32_t const ranks[kNB_INPUTS] = {3, 2, 3, 3, 6, 1, 2};
  for (int32_t i = 0; i < kNB_INPUTS; ++i)
    if (in[i].nbDims != ranks[i])
      return std::string(kINPUT_NAMES[i]) + " must have rank " + std::to_string(ranks[i]) + ", got " +
             dims_str(in[i]);
  int64_t const L = cache.d[1], H = cache.d[3], D = cache.d[5];
  int64_t const n = in[kPOSITIONS].d[0], c = in[kPOSITIONS].d[1];
  auto known = [](int64_t x) { return x >= 0; };
  auto differ = [&](int64_t a, int64_t b) { return known(a) && known(b) && a != b; };
  if (known(cache.d[0]) && cache.d[0] != 2) return "cache must be [2, L, B, H, cap, D], got " + dims_str(cache);
  if (known(D) && D % 2 != 0) return "head_dim D must be even (RoPE pairs), got cache " + dims_str(cache);
  int64_t const kv_width = known(L) && known(H) && known(D) ? L * 2 * H * D : -1;
  if (differ(in[kKV].d[2], kv_width))
    return "kv's last dimension must be L * 2 * H * D = " + std::to_string(kv_width) + " (cache " + dims_str(cache) +
           "), got kv " + dims_str(in[kKV]);
  if (differ(in[kKNORM].d[0], L) || differ(in[kKNORM].d[1], D))
    return "k_norm must be [L, D] of cache " + dims_str(cache) + ", got " + dims_str(in[kKNORM]);
  for (int32_t i : {kKV, kCOS, kSIN})
    if (differ(in[i].d[0], n) || differ(in[i].d[1], c))
      return std::string(kINPUT_NAMES[i]) + " must start with positions' [n, c] " + dims_str(in[kPOSITIONS]) +
             ", got " + dims_str(in[i]);
  for (int32_t i : {kCOS, kSIN})
    if (differ(in[i].d[2], D))
      return std::string(kINPUT_NAMES[i]) + " must be [n, c, D] with D = " + std::to_string(D) + ", got " +
             dims_str(in[i]);
  if (differ(in[kROWS].d[0], n))
    return "rows must be [n] with n = " + std::to_string(n) + " (positions' first dimension), got " +
           dims_str(in[kROWS]);
  if (!exact) return "";
  for (int32_t i = 0; i < kNB_INPUTS; ++i)
    for (int32_t k = 0; k < in[i].nbDims; ++k)
      if (in[i].d[k] < 0) return std::string(kINPUT_NAMES[i]) + " has an unknown dimension: " + dims_str(in[i]);
  if (D > 2048 || L > 65535 || H > 65535 || n * c > 2147483647LL)
    return "the kernel takes head_dim <= 2048, <= 65535 layers and KV heads and < 2^31 tokens, got cache " +
           dims_str(cache) + " and positions " + dims_str(in[kPOSITIONS]);
  return "";
}

class KVInjectPlugin final : public IPluginV3,
                             public IPluginV3OneCore,
                             public IPluginV3OneBuildV2,
                             public IPluginV3OneRuntime {
 public:
  explicit KVInjectPlugin(float eps) : mEps(eps) {}
  KVInjectPlugin(KVInjectPlugin const& other) : mEps(other.mEps), mRecorder(other.mRecorder) {}

  // IPluginV3
  IPluginCapability* getCapabilityInterface(PluginCapabilityType type) noexcept override {
    switch (type) {
      case PluginCapabilityType::kCORE: return static_cast<IPluginV3OneCore*>(this);
      case PluginCapabilityType::kBUILD: return static_cast<IPluginV3OneBuildV2*>(this);
      case PluginCapabilityType::kRUNTIME: return static_cast<IPluginV3OneRuntime*>(this);
    }
    return nullptr;
  }
  IPluginV3* clone() noexcept override {
    try {
      return new KVInjectPlugin(*this);
    } catch (...) {
      return nullptr;
    }
  }

  // IPluginV3OneCore
  AsciiChar const* getPluginName() const noexcept override { return kNAME; }
  AsciiChar const* getPluginVersion() const noexcept override { return kVERSION; }
  AsciiChar const* getPluginNamespace() const noexcept override { return kNAMESPACE; }

  // IPluginV3OneBuild(V2)
  int32_t getNbOutputs() const noexcept override { return 1; }

  int32_t getOutputDataTypes(DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes,
                             int32_t nbInputs) const noexcept override {
    if (nbInputs != kNB_INPUTS || nbOutputs != 1) return fail_io_count(nbInputs, nbOutputs);
    outputTypes[0] = inputTypes[kCACHE];
    return 0;
  }

  // The output is the cache: input 4's dimensions, the same expressions (no IExprBuilder call).
  int32_t getOutputShapes(DimsExprs const* inputs, int32_t nbInputs, DimsExprs const* /*shapeInputs*/,
                          int32_t /*nbShapeInputs*/, DimsExprs* outputs, int32_t nbOutputs,
                          IExprBuilder& /*exprBuilder*/) noexcept override {
    if (nbInputs != kNB_INPUTS || nbOutputs != 1) return fail_io_count(nbInputs, nbOutputs);
    if (inputs[kCACHE].nbDims != 6) {
      try {
        report(mRecorder, "cache must be [2, L, B, H, cap, D], got rank " + std::to_string(inputs[kCACHE].nbDims));
      } catch (...) {
      }
      return -1;
    }
    outputs[0] = inputs[kCACHE];
    return 0;
  }

  // kv, k_norm, cache and the output share T (float32 / float16 / bfloat16); cos, sin float32; rows, positions
  // int64; all linear. Decides position `pos` from inOut[0..pos] only, as TensorRT requires.
  bool supportsFormatCombination(int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
                                 int32_t nbOutputs) noexcept override {
    if (nbInputs != kNB_INPUTS || nbOutputs != 1 || pos < 0 || pos > kNB_INPUTS) return false;
    PluginTensorDesc const& d = inOut[pos].desc;
    if (d.format != TensorFormat::kLINEAR) return false;
    switch (pos) {
      case kKV: return dtype_code(d.type) >= 0;
      case kCOS:
      case kSIN: return d.type == DataType::kFLOAT;
      case kROWS:
      case kPOSITIONS: return d.type == DataType::kINT64;
      default: return d.type == inOut[kKV].desc.type;  // k_norm, cache, output
    }
  }

  int32_t configurePlugin(DynamicPluginTensorDesc const* in, int32_t nbInputs, DynamicPluginTensorDesc const* out,
                          int32_t nbOutputs) noexcept override {
    if (nbInputs != kNB_INPUTS || nbOutputs != 1) return fail_io_count(nbInputs, nbOutputs);
    Dims dims[kNB_INPUTS];
    for (int32_t i = 0; i < kNB_INPUTS; ++i) dims[i] = in[i].desc.dims;
    return check(dims, out[0].desc.dims, false);
  }

  // Output 0 aliases input 4 (the cache): written in place when TensorRT's aliased-plugin-I/O preview feature is
  // on; TensorRT ignores this otherwise, and enqueue then copies the cache to the output first.
  int32_t getAliasedInput(int32_t outputIndex) noexcept override { return outputIndex == 0 ? kCACHE : -1; }

  // IPluginV3OneRuntime
  int32_t onShapeChange(PluginTensorDesc const* in, int32_t nbInputs, PluginTensorDesc const* out,
                        int32_t nbOutputs) noexcept override {
    if (nbInputs != kNB_INPUTS || nbOutputs != 1) return fail_io_count(nbInputs, nbOutputs);
    Dims dims[kNB_INPUTS];
    for (int32_t i = 0; i < kNB_INPUTS; ++i) dims[i] = in[i].dims;
    return check(dims, out[0].dims, true);
  }

  int32_t enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* outputDesc, void const* const* inputs,
                  void* const* outputs, void* /*workspace*/, cudaStream_t stream) noexcept override {
    try {
      return launch(inputDesc, outputDesc, inputs, outputs, stream);
    } catch (...) {  // an error message's allocation
      return -1;
    }
  }

  // A clone that reports to this execution context's error recorder.
  IPluginV3* attachToContext(IPluginResourceContext* context) noexcept override {
    try {
      auto* p = new KVInjectPlugin(*this);
      p->mRecorder = context != nullptr ? context->getErrorRecorder() : nullptr;
      return p;
    } catch (...) {
      return nullptr;
    }
  }

  PluginFieldCollection const* getFieldsToSerialize() noexcept override {
    mField = PluginField("eps", &mEps, PluginFieldType::kFLOAT32, 1);
    mFields = PluginFieldCollection{1, &mField};
    return &mFields;
  }

 private:
  // enqueue: the shapes checked again (nothing is launched for a bad one), the cache copied to the output unless
  // aliased, then one kernel launch on `stream`. Returns 0, -1 for a bad shape or copy, or the launch's CUDA error.
  int32_t launch(PluginTensorDesc const* inputDesc, PluginTensorDesc const* outputDesc, void const* const* inputs,
                 void* const* outputs, cudaStream_t stream) const {
    Dims dims[kNB_INPUTS];
    for (int32_t i = 0; i < kNB_INPUTS; ++i) dims[i] = inputDesc[i].dims;
    if (check(dims, outputDesc[0].dims, true) != 0) return -1;
    int const dtype = dtype_code(inputDesc[kCACHE].type);
    if (dtype < 0 || outputDesc[0].type != inputDesc[kCACHE].type) {
      report(mRecorder, "cache and output must share one of float32 / float16 / bfloat16");
      return -1;
    }
    void* cache = outputs[0];
    if (cache != inputs[kCACHE]) {  // not aliased: the output starts as a copy of the cache
      size_t const bytes = static_cast<size_t>(volume(dims[kCACHE])) * (dtype == 0 ? 4 : 2);
      cudaError_t const err = cudaMemcpyAsync(cache, inputs[kCACHE], bytes, cudaMemcpyDeviceToDevice, stream);
      if (err != cudaSuccess) {
        report(mRecorder, std::string("copying the cache to the output failed: ") + cudaGetErrorString(err));
        return -1;
      }
    }
    Dims const& cd = dims[kCACHE];
    int const code = dflash_kv_inject(
        dtype, inputs[kKV], inputs[kKNORM], mEps, static_cast<float const*>(inputs[kCOS]),
        static_cast<float const*>(inputs[kSIN]), cache, static_cast<int64_t const*>(inputs[kROWS]),
        static_cast<int64_t const*>(inputs[kPOSITIONS]), dims[kPOSITIONS].d[0], dims[kPOSITIONS].d[1], cd.d[1],
        cd.d[2], cd.d[3], cd.d[4], cd.d[5], stream);
    if (code != 0) {
      report(mRecorder, std::string("dflash_kv_inject failed: ") + dflash_cuda_error_string(code) + " (cache " +
                            dims_str(cd) + ", positions " + dims_str(dims[kPOSITIONS]) + ")");
      return code;
    }
    return 0;
  }

  int32_t fail_io_count(int32_t nbInputs, int32_t nbOutputs) const noexcept {
    try {
      report(mRecorder, "takes 7 inputs (kv, k_norm, cos, sin, cache, rows, positions) and 1 output, got " +
                            std::to_string(nbInputs) + " and " + std::to_string(nbOutputs));
    } catch (...) {
    }
    return -1;
  }

  // 0 if the shapes fit (see check_shapes; `exact` also requires the output to be the cache's shape), else -1
  // with the reason reported.
  int32_t check(Dims const* in, Dims const& out, bool exact) const noexcept {
    try {
      std::string why = check_shapes(in, exact);
      bool same = out.nbDims == in[kCACHE].nbDims;
      for (int32_t i = 0; same && i < out.nbDims; ++i) same = out.d[i] == in[kCACHE].d[i];
      if (why.empty() && exact && !same)
        why = "the output must be the cache's shape " + dims_str(in[kCACHE]) + ", got " + dims_str(out);
      if (why.empty()) return 0;
      report(mRecorder, why);
    } catch (...) {
    }
    return -1;
  }

  float mEps;
  IErrorRecorder* mRecorder{nullptr};
  PluginField mField;
  PluginFieldCollection mFields{};
};

class KVInjectCreator final : public IPluginCreatorV3One {
 public:
  KVInjectCreator() {
    mField = PluginField("eps", nullptr, PluginFieldType::kFLOAT32, 1);
    mFields = PluginFieldCollection{1, &mField};
  }

  // eps is required: one finite kFLOAT32 > 0. nullptr (with a message) for a missing, mistyped or unknown field.
  IPluginV3* createPlugin(AsciiChar const* /*name*/, PluginFieldCollection const* fc,
                          TensorRTPhase /*phase*/) noexcept override {
    try {
      bool found = false;
      float eps = 0.0f;
      for (int32_t i = 0; fc != nullptr && i < fc->nbFields; ++i) {
        PluginField const& f = fc->fields[i];
        std::string const name = f.name != nullptr ? f.name : "";
        if (name != "eps") {
          report(nullptr, "unknown field '" + name + "'; the only field is eps (kFLOAT32)");
          return nullptr;
        }
        if (f.type != PluginFieldType::kFLOAT32 || f.length != 1 || f.data == nullptr) {
          report(nullptr, "field eps must be one kFLOAT32 value (the drafter's rms_norm_eps), got type " +
                              std::to_string(static_cast<int32_t>(f.type)) + " with length " +
                              std::to_string(f.length));
          return nullptr;
        }
        eps = *static_cast<float const*>(f.data);
        found = true;
      }
      if (!found) {
        report(nullptr, "missing field eps (kFLOAT32): k_norm's epsilon, the drafter config's rms_norm_eps");
        return nullptr;
      }
      if (!std::isfinite(eps) || eps <= 0.0f) {
        report(nullptr, "eps must be finite and > 0, got " + std::to_string(eps));
        return nullptr;
      }
      return new KVInjectPlugin(eps);
    } catch (...) {
      return nullptr;
    }
  }

  PluginFieldCollection const* getFieldNames() noexcept override { return &mFields; }
  AsciiChar const* getPluginName() const noexcept override { return kNAME; }
  AsciiChar const* getPluginVersion() const noexcept override { return kVERSION; }
  AsciiChar const* getPluginNamespace() const noexcept override { return kNAMESPACE; }

 private:
  PluginField mField;
  PluginFieldCollection mFields{};
};

}  // namespace

// The entry points IPluginRegistry::loadLibrary (and trtexec --dynamicPlugins) look up in a plugin library.
extern "C" {

DFLASH_EXPORT void setLoggerFinder(nvinfer1::ILoggerFinder* finder) noexcept { gLoggerFinder.store(finder); }

DFLASH_EXPORT nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators) noexcept {
  static KVInjectCreator creator;
  static nvinfer1::IPluginCreatorInterface* const creators[] = {&creator};
  nbCreators = 1;
  return creators;
}

}  // extern "C"
