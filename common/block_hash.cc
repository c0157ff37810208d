#include "common/block_hash.h"

#include <openssl/sha.h>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"

// SHA256_* is deprecated in OpenSSL 3 in favour of EVP, but it is the fastest
// allocation-free path for many tiny inputs (one per page).
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

namespace kvcache {
namespace {

void PutLe64(SHA256_CTX* ctx, uint64_t v) {
  uint8_t b[8];
  for (int i = 0; i < 8; ++i) b[i] = static_cast<uint8_t>(v >> (8 * i));
  SHA256_Update(ctx, b, sizeof(b));
}

}  // namespace

std::string BlockHash::ToHex() const {
  return absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
}

bool BlockHash::FromHex(absl::string_view hex, BlockHash* out) {
  if (hex.size() != 64) return false;
  for (char c : hex) {
    if (!absl::ascii_isxdigit(static_cast<unsigned char>(c))) return false;
  }
  const std::string raw = absl::HexStringToBytes(hex);
  std::memcpy(out->bytes.data(), raw.data(), out->bytes.size());
  return true;
}

BlockHash ComputeBlockHash(const BlockHash& parent, absl::string_view model_id, absl::string_view tenant_salt,
                           absl::Span<const int32_t> page_tokens) {
  SHA256_CTX ctx;
  SHA256_Init(&ctx);
  SHA256_Update(&ctx, parent.bytes.data(), parent.bytes.size());
  PutLe64(&ctx, model_id.size());
  SHA256_Update(&ctx, model_id.data(), model_id.size());
  PutLe64(&ctx, tenant_salt.size());
  SHA256_Update(&ctx, tenant_salt.data(), tenant_salt.size());
  PutLe64(&ctx, page_tokens.size());
  uint8_t buf[256];
  size_t n = 0;
  for (int32_t t : page_tokens) {
    const uint32_t u = static_cast<uint32_t>(t);
    for (int i = 0; i < 4; ++i) buf[n++] = static_cast<uint8_t>(u >> (8 * i));
    if (n == sizeof(buf)) {
      SHA256_Update(&ctx, buf, n);
      n = 0;
    }
  }
  if (n > 0) SHA256_Update(&ctx, buf, n);
  BlockHash out;
  SHA256_Final(out.bytes.data(), &ctx);
  return out;
}

std::vector<BlockHash> ChainBlockHashes(absl::Span<const int32_t> tokens, int page_tokens,
                                        absl::string_view model_id, absl::string_view tenant_salt) {
  std::vector<BlockHash> out;
  if (page_tokens <= 0) return out;
  const size_t full = tokens.size() / static_cast<size_t>(page_tokens);
  out.reserve(full);
  BlockHash parent = BlockHash::Zero();
  for (size_t i = 0; i < full; ++i) {
    parent = ComputeBlockHash(parent, model_id, tenant_salt, tokens.subspan(i * page_tokens, page_tokens));
    out.push_back(parent);
  }
  return out;
}

}  // namespace kvcache
