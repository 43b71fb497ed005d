// SHA-256 against the FIPS 180-4 example vectors (NIST "SHA256.pdf" / CSRC example values).
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <string>

#include "core/io/sha256.h"
#include "core/util/error.h"
#include "support/test_support.h"

namespace {

using hh::io::Sha256;
using hh::io::sha256_hex;

constexpr const char* kEmpty = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
constexpr const char* kAbc = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
constexpr const char* k448BitMsg = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
constexpr const char* k448BitDigest = "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1";
constexpr const char* k896BitMsg =
    "abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnopjklmnopqklmnopqrlmnopqrsmnopqrstnopqrstu";
constexpr const char* k896BitDigest = "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1";
constexpr const char* kMillionADigest = "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0";

TEST(Sha256, EmptyMessage) { EXPECT_EQ(sha256_hex(""), kEmpty); }

TEST(Sha256, Abc) { EXPECT_EQ(sha256_hex("abc"), kAbc); }

TEST(Sha256, TwoBlockMessage448Bits) { EXPECT_EQ(sha256_hex(k448BitMsg), k448BitDigest); }

TEST(Sha256, Message896Bits) { EXPECT_EQ(sha256_hex(k896BitMsg), k896BitDigest); }

TEST(Sha256, OneMillionA) { EXPECT_EQ(sha256_hex(std::string(1000000, 'a')), kMillionADigest); }

TEST(Sha256, MillionAInOneByteUpdates) {
  Sha256 h;
  for (int i = 0; i < 1000000; ++i) h.update("a", 1);
  EXPECT_EQ(h.hex_digest(), kMillionADigest);
}

// Streaming must not depend on where the block boundaries fall relative to the update calls.
TEST(Sha256, StreamingInOddChunksEqualsOneShot) {
  std::string msg;
  for (int i = 0; i < 5000; ++i) msg += static_cast<char>((i * 131 + 7) & 0xff);
  const std::string expected = sha256_hex(msg);
  for (const std::size_t chunk : {1u, 3u, 7u, 55u, 56u, 63u, 64u, 65u, 127u, 1000u, 4999u}) {
    Sha256 h;
    for (std::size_t pos = 0; pos < msg.size(); pos += chunk)
      h.update(msg.data() + pos, std::min(chunk, msg.size() - pos));
    EXPECT_EQ(h.hex_digest(), expected) << "chunk size " << chunk;
  }
}

// Lengths around the padding boundary (55/56/63/64 bytes) exercise the one- vs two-block padding.
TEST(Sha256, PaddingBoundaries) {
  struct Case {
    std::size_t len;
    const char* digest;
  };
  // Digests of 'a' * len.
  const Case cases[] = {
      {55, "9f4390f8d30c2dd92ec9f095b65e2b9ae9b0a925a5258e241c9f1e910f734318"},
      {56, "b35439a4ac6f0948b6d6f9e3c6af0f5f590ce20f1bde7090ef7970686ec6738a"},
      {63, "7d3e74a05d7db15bce4ad9ec0658ea98e3f06eeecf16b4c6fff2da457ddc2f34"},
      {64, "ffe054fe7ae0cb6dc65c3af9b61d5209f439851db43d0ba5997337df154668eb"},
  };
  for (const auto& c : cases) EXPECT_EQ(sha256_hex(std::string(c.len, 'a')), c.digest) << "length " << c.len;
}

TEST(Sha256, DigestBytesMatchHex) {
  Sha256 h;
  h.update("abc");
  const auto d = h.digest();
  EXPECT_EQ(d[0], 0xba);
  EXPECT_EQ(d[31], 0xad);
}

TEST(Sha256, FileHashEqualsStringHash) {
  const auto dir = hh::test::scratch_dir("sha256");
  const auto path = dir / "data.bin";
  std::string content(3 * 1024 * 1024 + 17, 'x');  // spans several read chunks
  for (std::size_t i = 0; i < content.size(); i += 97) content[i] = static_cast<char>(i & 0xff);
  std::ofstream(path, std::ios::binary).write(content.data(), static_cast<std::streamsize>(content.size()));
  EXPECT_EQ(hh::io::sha256_file_hex(path), sha256_hex(content));
}

TEST(Sha256, MissingFileNamesIt) {
  const auto path = hh::test::scratch_dir("sha256") / "absent.bin";
  try {
    hh::io::sha256_file_hex(path);
    FAIL() << "expected hh::Error";
  } catch (const hh::Error& e) {
    EXPECT_NE(std::string(e.what()).find("absent.bin"), std::string::npos) << e.what();
  }
}

}  // namespace
